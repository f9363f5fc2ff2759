"""No import cycle inside flashswitch/: every `import` / `from ... import` of a flashswitch module, at
module level or inside a function (a lazy import still ties the two modules together), makes an edge;
the graph must have no strongly connected component of two or more modules. A module importing its
own package's __init__ (flashswitch re-exporting its ops) is not counted: that is the package's
public face, not a dependency between two modules."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashswitch"


def modules() -> dict:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(name: str, path: Path, known: dict) -> set:
    """The flashswitch modules `name` imports (a `from pkg import sub` names the submodule)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t not in known and "." in t:
                t = t.rpartition(".")[0]
            if t in known and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def cycles(graph: dict) -> list:
    """Strongly connected components of two or more nodes (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["flashswitch.ops.call_plan"]  # the parser sees imports at all
    assert cycles(graph) == []
