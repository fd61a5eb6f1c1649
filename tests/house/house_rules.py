"""The package's import graph and its private-name reaches, read from the source.

Used by ``test_house.py``; kept apart so that the planted cases run the same code.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "darknet_metal"

# Cython sources hold Python imports and cimports on lines of their own.
_PYX_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w.]+))",
                         re.M)


def module_name(root: Path, path: Path) -> str:
    """``darknet_metal.ops.base`` for ``root/darknet_metal/ops/base.py``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_sources(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` (``.py``, ``.pyx`` and ``.pxd``) by name."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd") and "__pycache__" not in path.parts:
            found.setdefault(module_name(root, path), path)
    return found


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    if not level:
        return module
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(source: str, importer: str, is_package: bool, modules: Iterable[str],
               cython: bool = False) -> set[str]:
    """The package modules ``source`` imports: at the top, inside functions and under
    ``TYPE_CHECKING`` alike; ``from m import name`` counts as importing ``m.name`` where that
    is a module, else ``m``."""
    known = set(modules)
    pairs: list[tuple[str, list[str]]] = []
    if cython:
        for m in _PYX_IMPORT.finditer(source):
            if m.group(3):
                pairs.append((m.group(3), []))
            else:
                names = [n.strip().split(" as ")[0] for n in m.group(2).strip("()").split(",")]
                pairs.append((m.group(1), [n for n in names if n]))
    else:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                pairs += [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node.module or "", node.level, importer, is_package)
                pairs.append((target, [alias.name for alias in node.names]))
    found = set()
    for module, names in pairs:
        if not module.startswith(PACKAGE):
            continue
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
        if subs:
            found.update(subs)
        if len(subs) < len(names) or not names:
            # Importing a module's names (or the module) runs that module.
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module:
                found.add(module)
    found.discard(importer)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports, for the package under ``root``."""
    sources = package_sources(root)
    graph = {}
    for name, path in sources.items():
        graph[name] = imports_of(path.read_text(encoding="utf-8"), name,
                                 path.name == "__init__.py", sources,
                                 cython=path.suffix != ".py")
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected set of more than one module
    (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        # An explicit stack: the graph is deep enough to matter for recursion.
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        members.append(w)
                        if w == node:
                            break
                    if len(members) > 1 or node in graph.get(node, ()):
                        found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def private_reaches(source: str, importer: str = "") -> list[tuple[int, str]]:
    """(line, text) of each read of another object's or module's private name in
    ``source`` (the module ``importer``): ``x._name`` where ``x`` is not ``self``, ``cls`` or
    ``super()``; ``from m import _name`` and imports of a module under a private name
    (``m._shim``), except from inside the package that owns that name. Dunder names are
    public."""
    found = []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    def owned(module: str) -> bool:
        # A package's own modules may use its private names.
        return bool(importer) and (importer == module or importer.startswith(module + "."))

    def private_path(module: str) -> str | None:
        parts = module.split(".")
        for k, part in enumerate(parts):
            if private(part):
                return ".".join(parts[:k])
        return None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super"):
                continue
            found.append((node.lineno, f"{ast.unparse(owner)}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            holder = private_path(node.module)
            if holder is not None and not owned(holder):
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                if private(alias.name) and not owned(node.module):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                holder = private_path(alias.name)
                if holder is not None and not owned(holder):
                    found.append((node.lineno, f"import {alias.name}"))
    return sorted(found)


#: The floors of docs/architecture.md: a module imports only from its own floor and below.
FLOORS: dict[str, int] = {
    "darknet_metal.cli": 8, "darknet_metal.__main__": 8, "darknet_metal.serving": 8,
    "darknet_metal.diagnostics": 8,
    "darknet_metal.training": 7, "darknet_metal.evaluation": 7,
    "darknet_metal.network": 6,
    "darknet_metal.trainer": 5, "darknet_metal.export": 5,
    "darknet_metal.ops": 4, "darknet_metal.datasets": 4,
    "darknet_metal.inference": 3, "darknet_metal.export.graph": 3,
    "darknet_metal.runtime": 2, "darknet_metal.metal": 2, "darknet_metal.cpu": 2,
    "darknet_metal.model": 1,
    "darknet_metal.errors": 0, "darknet_metal.files": 0, "darknet_metal.fp32": 0,
    "darknet_metal.arguments": 0, "darknet_metal.cli_args": 0, "darknet_metal.image_errors": 0,
    "darknet_metal.version": 0,
}


def floor_of(module: str, floors: Mapping[str, int] = FLOORS) -> int | None:
    """The floor of ``module`` (that of its longest listed prefix), or None."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        found = floors.get(".".join(parts[:k]))
        if found is not None:
            return found
    return None


def upward_imports(graph: Mapping[str, Iterable[str]],
                   floors: Mapping[str, int] = FLOORS) -> list[str]:
    """``a -> b`` for each import from a lower floor to a higher one, and ``unplaced: m``
    for each module on no floor (the package's face imports from every floor: it is left
    out)."""
    found = []
    for module, deps in sorted(graph.items()):
        own = floor_of(module, floors)
        if own is None:
            if module != "darknet_metal":
                found.append(f"unplaced: {module}")
            continue
        for dep in sorted(deps):
            theirs = floor_of(dep, floors)
            if theirs is not None and theirs > own:
                found.append(f"{module} -> {dep}")
    return found
