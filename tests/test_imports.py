"""The house plan, checked from the source: the import graph of simulator/, policies/, profiles/ and run_sim.py,
read with ast (function-level imports count; imports under ``if TYPE_CHECKING:`` do not, they never run).

- no circle between modules, and none between packages (each sub-package is a node: ``simulator.core``,
  ``profiles.validation``, ...; a package's own top-level modules are the node named after it);
- the only arrows between the three sides: simulator -> policies; profiles -> simulator, policies; policies
  imports nothing from the others (the error type lives in ``policies.errors``, where all may import it);
- the command lines are imported only by ``run_sim.py``, the one place that dispatches between the sides.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SIDES = ("simulator", "policies", "profiles")
#: Side -> the other sides it may import.
ALLOWED = {"simulator": {"policies"}, "profiles": {"simulator", "policies"}, "policies": set(),
           "run_sim": {"simulator", "policies", "profiles"}}
COMMAND_LINES = {"simulator.studies.cli", "profiles.cli"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [REPO / "run_sim.py"] + [p for side in SIDES for p in sorted((REPO / side).rglob("*.py"))]
    return {_module_name(p): p for p in files}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import that runs, resolving relative ones; ``from a import b`` gives a.b."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            found.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
            found.append((base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported project module: line of the first such import}."""
    sources = _sources()
    graph: dict[str, dict[str, int]] = {}
    for module, path in sources.items():
        edges: dict[str, int] = {}
        for name, line in _imported_names(ast.parse(path.read_text(), str(path)), module,
                                          path.name == "__init__.py"):
            parts = name.split(".")
            # the longest prefix that is one of our modules (``from a.b import c``: a.b.c if a module, else a.b)
            target = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in sources),
                          None)
            if target is not None and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _package(module: str, sources: dict[str, Path]) -> str:
    """The package node of a module: its sub-package (a package's __init__ is in it), or the side's top level."""
    if sources[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0] or module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan, recursive: the graph has a few hundred nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for component in components:
        members, start = set(component), min(component)
        # shortest way back to start inside the component (breadth first)
        previous = {start: None}
        queue = [start]
        end = None
        while queue and end is None:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    end = v
                    break
                if w in members and w not in previous:
                    previous[w] = v
                    queue.append(w)
        path = [start]
        v = end
        while v is not None and v != start:
            path.insert(1, v)
            v = previous[v]
        cycles.append(path + [start])
    return cycles


def _show(cycles: list[list[str]], graph: dict[str, dict[str, int]] | None = None) -> str:
    return "\n".join("  " + " -> ".join(cycle) for cycle in cycles)


def test_no_circle_between_modules():
    graph = import_graph()
    cycles = _cycles({m: set(edges) for m, edges in graph.items()})
    assert not cycles, "import circles between modules:\n" + _show(cycles)


def test_no_circle_between_packages():
    sources = _sources()
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for module, edges in graph.items():
        here = _package(module, sources)
        packages.setdefault(here, set())
        for target in edges:
            there = _package(target, sources)
            if there != here:
                packages[here].add(there)
                why.setdefault((here, there), f"{module} -> {target}")
    cycles = _cycles(packages)
    lines = []
    for cycle in cycles:
        lines.append("  " + " -> ".join(cycle))
        lines.extend(f"      ({why[(a, b)]})" for a, b in zip(cycle, cycle[1:]))
    assert not cycles, "import circles between packages:\n" + "\n".join(lines)


def test_only_the_allowed_arrows_between_the_sides():
    sources = _sources()
    wrong = []
    for module, edges in import_graph().items():
        side = module.split(".")[0]
        for target, line in edges.items():
            other = target.split(".")[0]
            if other != side and other not in ALLOWED[side]:
                wrong.append(f"  {sources[module].relative_to(REPO)}:{line}: {module} -> {target}")
    assert not wrong, "arrows outside simulator -> policies, profiles -> simulator/policies:\n" + "\n".join(wrong)


def test_only_run_sim_imports_a_command_line():
    sources = _sources()
    wrong = [f"  {sources[module].relative_to(REPO)}:{line}: {module} -> {target}"
             for module, edges in import_graph().items() if module != "run_sim"
             for target, line in edges.items() if target in COMMAND_LINES]
    assert not wrong, "library modules import a command line:\n" + "\n".join(wrong)


def test_the_graph_sees_function_level_imports_and_skips_type_checking_blocks(tmp_path):
    code = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import simulator.config\nelse:\n"
            "    import simulator.metrics\ndef f():\n    from policies import errors\n")
    names = {name for name, _ in _imported_names(ast.parse(code), "simulator.x", False)}
    assert "simulator.metrics" in names and "policies.errors" in names and "simulator.config" not in names
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_simulator_and_the_policies_never_import_torch_or_transformers():
    """A researcher runs what-ifs without the profile extra: no import of torch or transformers (function-level
    ones included) anywhere under simulator/ or policies/."""
    offending = []
    for module, path in _sources().items():
        if not module.startswith(("simulator", "policies")):
            continue
        for name, line in _imported_names(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            if name.split(".")[0] in ("torch", "transformers"):
                offending.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not offending, "\n".join(offending)


def test_the_fleet_sits_beside_the_engine_room_never_inside_it():
    """simulator/fleet (replicas, routers) imports the engine room, simulator/core; the engine room never imports the
    fleet (the studies run a config through :func:`simulator.fleet.run`, one engine or a fleet)."""
    graph = import_graph()
    assert any(target.startswith("simulator.core") for module, edges in graph.items()
               if module.startswith("simulator.fleet") for target in edges)
    wrong = [f"{module} -> {target}" for module, edges in graph.items() if module.startswith("simulator.core")
             for target in edges if target.startswith("simulator.fleet")]
    assert not wrong, "the engine room imports the fleet:\n" + "\n".join(wrong)


def test_disaggregated_serving_sits_in_the_fleet_room_and_its_study_among_the_studies():
    """simulator/fleet/disagg.py (prefill and decode instances and the KV link between them) builds on the engine room
    and the fleet's routers; the study of it (simulator/studies/disagg.py) runs configs through the fleet; neither the
    engine room nor the fleet imports a study."""
    graph = import_graph()
    assert {"simulator.core.engine", "simulator.fleet.routers", "simulator.fleet.fleet"} <= set(
        graph["simulator.fleet.disagg"])
    assert "simulator.fleet" in graph["simulator.studies.disagg"]
    wrong = [f"{module} -> {target}" for module, edges in graph.items()
             if module.startswith(("simulator.core", "simulator.fleet")) for target in edges
             if target.startswith("simulator.studies")]
    assert not wrong, "the engine room or the fleet imports a study:\n" + "\n".join(wrong)
