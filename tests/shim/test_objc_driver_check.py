"""The Objective-C Metal driver type-checks under ARC for arm64 macOS against the stub
headers, and the check catches a wrong selector, a wrong argument type and a missing
bridged cast (mutated copies of the driver must fail)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "shim" / "check_objc.sh"
DRIVER = ROOT / "shim" / "drivers" / "metal_driver.m"

pytestmark = pytest.mark.skipif(
    shutil.which("clang") is None,
    reason="clang is not installed (apt-get install clang); it type-checks the Metal driver",
)


def check(path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), str(path)], capture_output=True, text=True)


def test_driver_passes():
    proc = check(DRIVER)
    assert proc.returncode == 0, proc.stderr


# (original text, mutated text, expected clang diagnostic)
MUTATIONS = [
    pytest.param(
        "    if (@available(macOS 15.0, *)) {\n        options.mathMode = MTLMathModeSafe;",
        "    options.mathMode = MTLMathModeSafe;\n    if (1) {",
        "only available on macOS 15.0",
        id="math-mode-without-availability-check",
    ),
    pytest.param(
        "[encoder dispatchThreads:size threadsPerThreadgroup:group]",
        "[encoder dispatchThread:size threadsPerThreadgroup:group]",
        "dispatchThread:threadsPerThreadgroup:",
        id="wrong-selector",
    ),
    pytest.param(
        "[encoder dispatchThreads:size threadsPerThreadgroup:group]",
        "[encoder dispatchThreads:d->grid[0] threadsPerThreadgroup:group]",
        "MTLSize",
        id="integer-for-MTLSize",
    ),
    pytest.param(
        "[encoder setBuffer:(__bridge id<MTLBuffer>)d->buffers[i]",
        "[encoder setBuffer:d->offsets[i]",
        "id<MTLBuffer>",
        id="integer-for-buffer",
    ),
    pytest.param(
        "[encoder setBuffer:(__bridge id<MTLBuffer>)d->buffers[i]",
        "[encoder setBuffer:(id<MTLBuffer>)d->buffers[i]",
        "bridged cast",
        id="missing-bridged-cast",
    ),
    pytest.param(
        "facts->apple7 = [mtl supportsFamily:MTLGPUFamilyApple7] ? 1 : 0;",
        'facts->apple7 = [mtl supportsFamily:@"Apple7"] ? 1 : 0;',
        "MTLGPUFamily",
        id="string-for-enum",
    ),
]


@pytest.mark.parametrize(("original", "mutated", "diagnostic"), MUTATIONS)
def test_mutated_driver_fails(tmp_path, original, mutated, diagnostic):
    text = DRIVER.read_text()
    assert original in text, "the driver changed: update this mutation"
    copy = tmp_path / "metal_driver.m"
    copy.write_text(text.replace(original, mutated, 1))
    proc = check(copy)
    assert proc.returncode != 0
    assert "error:" in proc.stderr
    assert diagnostic in proc.stderr, proc.stderr


def test_the_library_compiles_without_fast_math():
    # Safe math where the OS has mathMode, else fastMathEnabled = NO (Metal's default is on).
    text = DRIVER.read_text()
    assert "options.mathMode = MTLMathModeSafe;" in text
    assert "options.fastMathEnabled = NO;" in text
    call = text[text.index("newLibraryWithSource:device.sources[i]"):]
    assert call.split("]")[1].split()[0] == "options:options", call[:120]
