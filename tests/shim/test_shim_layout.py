"""The portable core's files call one another without cycles, and shim/README.md's file map
names every file of the core."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "shim" / "core"

COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
# A non-static function definition starts at column 0 with its return type.
DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(dm_\w+)\(", re.MULTILINE)
CALL = re.compile(r"\b(dm_\w+)\s*\(")


def call_graph() -> dict[str, set[str]]:
    """File -> the other core files whose functions it calls."""
    texts = {p.name: COMMENT.sub("", p.read_text()) for p in sorted(CORE.glob("*.c"))}
    owner = {name: f for f, text in texts.items() for name in DEFINITION.findall(text)}
    return {
        f: {owner[name] for name in CALL.findall(text) if owner.get(name, f) != f}
        for f, text in texts.items()
    }


def test_call_graph_is_read():
    graph = call_graph()
    assert "stream.c" in graph["dispatch_list.c"]
    assert "stats.c" in graph["pool.c"]


def test_core_files_call_one_another_without_cycles():
    graph = call_graph()
    done: set[str] = set()

    def visit(f: str, path: list[str]) -> None:
        assert f not in path, "call cycle: " + " -> ".join(path[path.index(f) :] + [f])
        if f in done:
            return
        for g in sorted(graph[f]):
            visit(g, path + [f])
        done.add(f)

    for f in graph:
        visit(f, [])


def test_readme_names_every_core_file():
    readme = (ROOT / "shim" / "README.md").read_text()
    for path in sorted(CORE.iterdir()):
        assert f"`{path.name}`" in readme or f"`core/{path.name}`" in readme, path.name
