"""What the Metal driver is given: .metal sources with local includes inlined."""

import pathlib
import re

from darknet_metal.metal import _shim

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_sources_are_the_shader_files_with_includes_inlined():
    sources = dict(_shim.shader_sources())
    files = sorted((ROOT / "shaders").glob("*.metal")) + sorted(
        (ROOT / "shim" / "kernels").glob("*.metal")
    )
    assert sorted(sources) == sorted(p.name for p in files)
    for path in files:
        name, text = path.name, sources[path.name]
        original = path.read_text()
        assert not re.search(r'^\s*#\s*include\s*"', text, re.MULTILINE), name
        for header in re.findall(r'^\s*#\s*include\s*"([^"]+)"', original, re.MULTILINE):
            for line in (path.parent / header).read_text().splitlines():
                if not re.match(r'\s*#\s*include\s*"', line):
                    assert line in text, (name, header, line)


def test_inline_includes_replaces_only_local_includes(tmp_path):
    (tmp_path / "a.h").write_text("struct a_args { uint n; };\n")
    text = '#include <metal_stdlib>\n#include "a.h"\nkernel void k() {}\n'
    out = _shim._inline_includes(text, str(tmp_path), "k.metal")
    assert out == "#include <metal_stdlib>\nstruct a_args { uint n; };\n\nkernel void k() {}\n"


def test_nested_includes_are_inlined_once(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\nA\n')
    (tmp_path / "b.h").write_text("B\n")
    text = '#include "a.h"\n#include "b.h"\nK\n'
    assert _shim._inline_includes(text, str(tmp_path), "k.metal") == "B\n\nA\n\n\nK\n"
