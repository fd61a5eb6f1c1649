"""The Objective-C Metal driver type-checks under ARC for arm64 macOS against the stub
headers standing for the macOS 13.3 SDK and for the 15 SDK, and the check catches a wrong
selector, a wrong argument type, a missing bridged cast and a 15-SDK name used without the
SDK guard (mutated copies of the driver must fail)."""

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
        # mathMode is a macOS 15 SDK name: @available is a run-time check that does not hide
        # it from an older SDK's compiler.
        "#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000\n",
        "#if 1\n",
        "property 'mathMode' not found on object of type 'MTLCompileOptions *'",
        id="math-mode-without-sdk-guard",
    ),
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


def test_the_stubs_declare_what_each_sdk_declares():
    stubs = (ROOT / "shim" / "stubs" / "Metal" / "Metal.h").read_text()
    guarded = stubs[stubs.index("#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000"):]
    newer, older = guarded.split("#else", 1)
    assert "MTLMathMode mathMode" in newer and "API_DEPRECATED" in newer
    assert "fastMathEnabled" in older and "MTLMathMode mathMode" not in older.split("#endif")[0]
