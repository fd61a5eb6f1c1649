"""tools/darknet_cpu_build.py and tools/cpu_train_against_darknet.py: the source fixes, the
iteration lines read from Darknet, and the whole comparison around a stand-in for the darknet
executable (the real one needs a Darknet build: docs/performance.md says how)."""

import importlib.util
import json
import stat
import subprocess
import sys

import pytest
from shared_paths import ROOT

TOOLS = ROOT / "tools"


def _tool(name):
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
    return module


def _darknet_tree(root, fixes):
    """A file per fix holding its text once, inside some other text."""
    for name, text, _ in fixes:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"before\n{text}after\n")


def test_each_fix_is_applied_once(tmp_path):
    build = _tool("darknet_cpu_build")
    assert len(build.FIXES) == 6
    _darknet_tree(tmp_path, build.FIXES)
    build.apply_fixes(tmp_path)
    for name, _, replacement in build.FIXES:
        assert (tmp_path / name).read_text() == f"before\n{replacement}after\n"
    # The -Ofast flag keeps infinities and NaNs; the CPU's batch-norm backward sums beta's
    # gradient; the col2im zeroing is gone.
    assert '"-Ofast -fno-finite-math-only"' in (tmp_path / "src-lib/CMakeLists.txt").read_text()
    assert "backward_bias(l.bias_updates" in (tmp_path / "src-lib/batchnorm_layer.cpp").read_text()
    assert "caffe_set" not in (tmp_path / "src-lib/col2im.cpp").read_text()


@pytest.mark.parametrize("count", [0, 2])
def test_a_fix_whose_text_is_not_there_once_stops_the_build(tmp_path, count):
    build = _tool("darknet_cpu_build")
    _darknet_tree(tmp_path, build.FIXES)
    name, text, _ = build.FIXES[2]
    path = tmp_path / name
    path.write_text(path.read_text().replace(text, "") + text * count)
    with pytest.raises(build.BuildError, match=rf"{name}: expected .* once, found it {count}"):
        build.apply_fixes(tmp_path)


def test_darknet_iteration_lines_are_recognised():
    tool = _tool("cpu_train_against_darknet")
    # As Darknet V5's detector.cpp writes them (without and with its colour codes).
    line = ("12: loss=5.881, avg loss=175.189, last=none, best=none, mAP=DISABLED, "
            "rate=0.00001000, load 16=28.2 milliseconds, train=7.0 seconds, 64 images, "
            "time remaining=7 seconds\n")
    assert tool.DARKNET_ITERATION.match(line)
    assert tool.DARKNET_ITERATION.match("\x1b[1;37m12\x1b[0m: loss=5.881, avg loss=1.0\n")
    for other in ("Resizing to initial size: 416 x 416\n", "-> loaded a total of 614 images\n",
                  "loss=5.881\n"):
        assert not tool.DARKNET_ITERATION.match(other)


STAND_IN = """\
#!{python}
import json, os, sys, time
# Darknet's command line: detector train DATA CFG -dont_show -nocolor; answers from stdin.
assert sys.argv[1:3] == ["detector", "train"] and sys.stdin.read() == "yes\\n"
with open(os.path.join(os.getcwd(), "env.json"), "w") as f:
    json.dump({{k: os.environ.get(k) for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS",
                                               "OMP_NUM_THREADS")}}, f)
print("-> loaded a total of 64 images", flush=True)
pause = 0.3 if os.environ.get("OMP_NUM_THREADS") == "2" else 0.6
for i in range(1, 7):
    time.sleep(pause)
    print(f"{{i}}: loss=5.0, avg loss=5.0, rate=0.001, train=0.1 seconds, 16 images",
          flush=True)
"""


def test_the_comparison_runs_both_and_keeps_darknets_best_setting(tmp_path):
    work = tmp_path / "work"
    darknet = work / "darknet" / "build" / "src-cli" / "darknet"
    darknet.parent.mkdir(parents=True)
    darknet.write_text(STAND_IN.format(python=sys.executable))
    darknet.chmod(darknet.stat().st_mode | stat.S_IXUSR)
    (work / "darknet" / "libkeep_blas_threads.so").write_bytes(b"")
    out = work / "summary.json"
    done = subprocess.run(
        [sys.executable, str(TOOLS / "cpu_train_against_darknet.py"), "--darknet-source",
         str(tmp_path / "unused"), "--work", str(work), "--models", "yolov3-tiny",
         "--sizes", "64", "--batch", "2", "--iterations", "6", "--skip", "1", "--threads",
         "2", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    settings = {r["setting"] for r in result["runs"] if r["program"] == "darknet"}
    assert settings == {"stock", "blas-2 omp-1", "blas-2 omp-2"}
    envs = {p.parent.name: json.loads(p.read_text()) for p in work.glob("darknet-*/env.json")}
    stock = envs["darknet-yolov3-tiny-64-stock-r0"]
    lifted = envs["darknet-yolov3-tiny-64-blas-2-omp-2-r0"]
    assert stock == {"LD_PRELOAD": None, "OPENBLAS_NUM_THREADS": None, "OMP_NUM_THREADS": None}
    assert lifted["LD_PRELOAD"].endswith("libkeep_blas_threads.so")
    assert (lifted["OPENBLAS_NUM_THREADS"], lifted["OMP_NUM_THREADS"]) == ("2", "2")
    # The stand-in's iterations end 0.3 s apart under omp-2, 0.6 s otherwise: batch 2 makes
    # about 6.7 images/s there, and that setting is the best.
    [row] = result["summary"]
    assert row["darknet_setting"] == "blas-2 omp-2"
    assert row["darknet_rates"][0] == pytest.approx(2 / 0.3, rel=0.25)
    ours = [r for r in result["runs"] if r["program"] == "darknet-metal"]
    assert len(ours) == 1 and ours[0]["images_per_second"] > 0 and ours[0]["peak_mib"] > 0
    assert row["ratio"] == pytest.approx(ours[0]["images_per_second"] / row["darknet_rates"][0])
    assert "| yolov3-tiny 64 | blas-2 omp-2:" in done.stdout
