"""ridge's packages form layers: no chain of imports between packages comes back to where it started. Read
from the source's import statements, the ones inside functions included."""

import ast
from collections import defaultdict
from pathlib import Path

import ridge

SRC = Path(ridge.__file__).parent
def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where; a top-level module counts as a package of its own."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        source = parts[0] if parts[0] != "__init__" else "ridge"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ridge":
                modules = [node.module] if node.module != "ridge" else [f"ridge.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.split(".")[0] == "ridge"]
            else:
                continue
            for module in modules:
                target = module.split(".")[1] if "." in module else "ridge"
                if target != source:
                    found[(source, target)].append(f"{'/'.join(parts)}.py:{node.lineno}")
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports that comes back to where it started, or None: depth first, a node on the path met again."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = "done"
        path.pop()
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node))), None)


def test_packages_form_layers():
    imports = package_imports()
    assert ("cli", "bench") in imports and ("engine", "kv") in imports  # the reader sees the imports it should
    graph: dict[str, set[str]] = {}
    for source, target in imports:
        graph.setdefault(source, set()).add(target)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} at {imports[(a, b)][0]}" for a, b in zip(cycle, cycle[1:], strict=False))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None
