"""The router's floors and the connector's, and the absence of import circles, read from
the source.

Every import counts: at the top, inside functions, and under `TYPE_CHECKING`. A floor
may import its own floor and those below it; nothing imports in a circle, in `proxy/`
or in `connector/`; and the connector's two sides, P's (`connector.prefill`) and D's
(`connector.decode`), on one floor, never import each other. docs/ARCHITECTURE.md
(section 1) explains the floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# proxy's floors, top first; a module's floor is that of its longest listed prefix.
FLOORS: list[tuple[str, ...]] = [
    ("proxy", "proxy.__main__", "proxy.cli", "proxy.serve", "proxy.workers"),
    ("proxy.api",),
    ("proxy.flow",),
    ("proxy.pool",),
    ("proxy.upstream", "proxy.protocol"),
    ("proxy.choices", "proxy.config", "proxy.errors", "proxy.metrics", "proxy.loop_metrics",
     "proxy.tracing", "proxy.task_scope"),
]

# The connector's floors, top first: the facade vLLM loads, its two roles (each a
# composition of a P half and a D half), the two sides, and what crosses the hops with
# what both sides share.
CONNECTOR_FLOORS: list[tuple[str, ...]] = [
    ("connector", "connector.connector"),
    ("connector.scheduler", "connector.worker"),
    ("connector.prefill", "connector.decode"),
    ("connector.protocol", "connector.shared", "connector.vllm_compat", "connector.config"),
]
# Sides on one floor that never import each other: what they share is below them.
CONNECTOR_SIDES: tuple[str, ...] = ("connector.prefill", "connector.decode")


def module_names(package: str) -> dict[str, Path]:
    names = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports, wherever in the file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            # `from a import b` imports module a.b when there is one, else a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c` names a, a.b, a.b.c
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(package: str) -> dict[str, set[str]]:
    known = module_names(package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def floor_of(module: str, floors: list[tuple[str, ...]] = FLOORS) -> int:
    best, best_length = -1, -1
    for floor, prefixes in enumerate(floors):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_length:
                best, best_length = floor, len(prefix)
    assert best >= 0, f"{module} is on no floor: add it to its package's floors"
    return best


def upward(package: str, floors: list[tuple[str, ...]]) -> list[str]:
    """Each import of `package` from a floor to a higher one, as a line."""
    return [
        f"{module} ({floors[floor_of(module, floors)][0]}) imports "
        f"{target} ({floors[floor_of(target, floors)][0]})"
        for module, targets in sorted(graph(package).items())
        for target in sorted(targets)
        if floor_of(target, floors) < floor_of(module, floors)  # smaller: a higher floor
    ]


def side_of(module: str, sides: tuple[str, ...]) -> str | None:
    return next((side for side in sides if module == side or module.startswith(side + ".")),
                None)


def crossings(edges: dict[str, set[str]], sides: tuple[str, ...]) -> list[str]:
    """Each import from one of `sides` into another, as a line."""
    return [
        f"{module} imports {target}"
        for module, targets in sorted(edges.items())
        for target in sorted(targets)
        if side_of(module, sides) is not None
        and side_of(target, sides) not in (None, side_of(module, sides))
    ]


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import X\n"
                      "def f():\n    import p.b\n    from p import c\n")
    known = {name: source for name in ("p", "p.a", "p.b", "p.c", "p.m")}
    assert imports_of("p.m", source, known) == {"p.a", "p.b", "p.c"}


@pytest.mark.parametrize("package", ["proxy", "connector"])
def test_no_module_imports_in_a_circle(package: str) -> None:
    assert circles(graph(package)) == []


def test_the_side_check_finds_a_crossing() -> None:
    edges = {"c.p.a": {"c.d.b", "c.s"}, "c.d.b": {"c.s"}, "c.p": {"c.p.a"}, "c.s": set()}
    assert crossings(edges, ("c.p", "c.d")) == ["c.p.a imports c.d.b"]
    assert crossings({"c.d": {"c.p"}}, ("c.p", "c.d")) == ["c.d imports c.p"]


def test_each_floor_of_the_router_imports_only_floors_below_it() -> None:
    assert upward("proxy", FLOORS) == []


def test_each_floor_of_the_connector_imports_only_floors_below_it() -> None:
    assert upward("connector", CONNECTOR_FLOORS) == []


def test_the_connectors_prefill_and_decode_sides_never_import_each_other() -> None:
    assert crossings(graph("connector"), CONNECTOR_SIDES) == []
