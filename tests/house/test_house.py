"""The house rules, read from the source: no import circle in the package (imports inside
functions and under ``TYPE_CHECKING`` count), no module reading another's private names, and
every package saying what it owns and what it may import. Each check is also run on a planted
breach, to show that it would fail."""

from __future__ import annotations

from pathlib import Path

from house_rules import (
    cycles,
    import_graph,
    imports_of,
    package_sources,
    private_reaches,
    upward_imports,
)

ROOT = Path(__file__).resolve().parents[2]


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 100  # the whole package was read
    assert cycles(graph) == []


def test_a_planted_cycle_is_found_type_only_imports_included(tmp_path: Path) -> None:
    pkg = tmp_path / "darknet_metal"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("from darknet_metal.a.two import thing\n")
    (pkg / "a" / "two.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from darknet_metal.a import three\n")
    (pkg / "a" / "three.py").write_text(
        "def late():\n    from .one import anything\n    return anything\n")
    (pkg / "apart.py").write_text("import darknet_metal.a.one\n")
    assert cycles(import_graph(tmp_path)) == [
        ["darknet_metal.a.one", "darknet_metal.a.three", "darknet_metal.a.two"]]


def test_every_import_runs_down_the_floors() -> None:
    assert upward_imports(import_graph(ROOT)) == []


def test_a_planted_upward_import_and_an_unplaced_module_are_found() -> None:
    graph = {"darknet_metal.model.cfg": {"darknet_metal.ops.base"},
             "darknet_metal.ops.base": {"darknet_metal.model.cfg"},
             "darknet_metal.network": {"darknet_metal.trainer.trainer"},
             "darknet_metal.trainer.trainer": {"darknet_metal.network"},
             "darknet_metal.somewhere.new": {"darknet_metal.errors"}}
    assert upward_imports(graph) == ["darknet_metal.model.cfg -> darknet_metal.ops.base",
                                     "unplaced: darknet_metal.somewhere.new",
                                     "darknet_metal.trainer.trainer -> darknet_metal.network"]


def test_cython_imports_are_read() -> None:
    found = imports_of("from darknet_metal.errors import ArgumentError\n"
                       "from darknet_metal.cpu.step cimport NativeStep\n",
                       "darknet_metal.cpu.conv", False,
                       ["darknet_metal.errors", "darknet_metal.cpu.step"], cython=True)
    assert found == {"darknet_metal.errors", "darknet_metal.cpu.step"}


def test_no_module_reads_another_modules_private_names() -> None:
    reaches = []
    for name, path in package_sources(ROOT).items():
        if path.suffix == ".py":
            reaches += [f"{path.relative_to(ROOT)}:{line}: {text}"
                        for line, text in private_reaches(path.read_text(encoding="utf-8"),
                                                          name)]
    assert reaches == []


def test_planted_private_reaches_are_found() -> None:
    source = (
        "from darknet_metal.inference.boxes import _iou\n"
        "from darknet_metal.metal._shim import aligned_empty\n"
        "import darknet_metal.metal._shim\n"
        "class A:\n"
        "    def f(self, net):\n"
        "        self._own = super()._also_own\n"
        "        return net._backend, self.net._lock, cls._fine, type(net).__name__\n"
    )
    assert [text for _, text in private_reaches(source, "darknet_metal.inference.stream")] == [
        "from darknet_metal.inference.boxes import _iou",
        "from darknet_metal.metal._shim import ...",
        "import darknet_metal.metal._shim",
        "net._backend",
        "self.net._lock",
    ]
    # A package's own modules may use its private names.
    assert private_reaches("from darknet_metal.metal import _shim\n",
                           "darknet_metal.metal") == []


def test_every_package_says_what_it_owns_and_may_import() -> None:
    silent = []
    for init in sorted((ROOT / "darknet_metal").rglob("__init__.py")):
        text = init.read_text(encoding="utf-8")
        if init.parent.name in ("cpu", "data") or init.parent == ROOT / "darknet_metal":
            continue
        if "Owns" not in text or "May import" not in text:
            silent.append(str(init.relative_to(ROOT)))
    assert silent == []
