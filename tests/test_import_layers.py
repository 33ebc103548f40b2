"""The project's modules import one another without circles, and the foundation never reaches up.

Every project .py file is read with `ast`, and its imports of project modules become edges of a
directed graph: imports inside functions count too (a deferred import still ties two modules
together and only hides the circle until it bites); imports under `if TYPE_CHECKING:` do not (they
never run). `import a.b` and `from a import b` (b a submodule) point at `a.b`, `from a.b import
name` at `a.b`. The stage folders beside `autopar/` import as `autopar.<stage>` (see
autopar/_source_tree.py); the modules of tests/, benchmarks/ and examples/ import their neighbours by
bare name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"autopar": "autopar", "autopar.profiler": "profiler", "autopar.cost_models": "cost_models",
                "autopar.searcher": "searcher", "autopar.runtime": "runtime"}
SCRIPT_DIRS = ("tests", "benchmarks", "examples")  # folders of top-level modules (on sys.path when they run)

FOUNDATION = ("autopar.graph", "autopar.models", "autopar.plan_schema", "autopar.cluster", "autopar.errors")
ABOVE_FOUNDATION = ("autopar.api", "autopar.cli", "autopar.profiler", "autopar.cost_models", "autopar.searcher",
                    "autopar.runtime")

# Circles kept on purpose: frozenset of their modules -> why. None today.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    """Every project module by its import name (`tests:conftest` for a module of tests/)."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    for folder in SCRIPT_DIRS:
        for path in (ROOT / folder).glob("*.py"):
            found[f"{folder}:{path.stem}"] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement that can run, however deeply nested."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        yield from _imports(node)


def _targets(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that the file imports, anywhere in it."""
    script_folder = name.partition(":")[0] if ":" in name else None
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        if script_folder and f"{script_folder}:{dotted}" in modules:
            return f"{script_folder}:{dotted}"
        while dotted:  # `import a.b.c` of a project module, or the deepest project package it names
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [resolve(alias.name) for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name` the module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else resolve(source)
                       for alias in node.names]
        found.update(target for target in targets if target is not None)
    found.discard(name)
    return found


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in _targets(name, path, modules))
    return graph


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _cycle_text(graph: nx.DiGraph, members: set[str]) -> str:
    cycle = [source for source, _ in nx.find_cycle(graph.subgraph(members))]
    return " -> ".join([*cycle, cycle[0]])


def test_the_scan_sees_the_project():
    graph = import_graph()
    assert graph.has_edge("autopar.api", "autopar.plan_schema")
    assert graph.has_edge("autopar.runtime.parallelize", "autopar.runtime.tensor_parallel.module_rules")
    assert graph.has_edge("autopar.cli.commands", "autopar.cli.run")  # an import inside a function
    assert graph.has_edge("tests:test_runtime_parity", "tests:parity_harness")
    assert graph.number_of_edges() > 300


def test_no_import_cycles():
    """Each group of modules that import one another in a circle is shown once, with one of its circles."""
    graph = import_graph()
    circles = [members for members in nx.strongly_connected_components(graph)
               if len(members) > 1 and frozenset(members) not in KNOWN_CYCLES]
    shown = "\n".join(f"{len(members)} modules: {_cycle_text(graph, members)}" for members in sorted(circles, key=len))
    assert not circles, f"{len(circles)} import circle(s) among project modules:\n{shown}"


def test_known_cycles_are_still_cycles():
    graph = import_graph()
    for members, reason in KNOWN_CYCLES.items():
        assert nx.is_strongly_connected(graph.subgraph(members)), f"no longer a circle, drop it: {reason}"


def test_the_foundation_does_not_import_the_api_the_cli_or_a_stage():
    """Not even through a module in between: each path is shown up to the first module above."""
    graph = import_graph()
    allowed = graph.subgraph([name for name in graph if not _within(name, ABOVE_FOUNDATION)])
    offenders = set()
    for source in graph:
        if not _within(source, FOUNDATION):
            continue
        paths = nx.single_source_shortest_path(allowed, source)  # through modules that are not above
        for middle, path in paths.items():
            offenders.update(" -> ".join([*path, target]) for target in graph.successors(middle)
                             if _within(target, ABOVE_FOUNDATION))
    assert not offenders, "\n".join(sorted(offenders))
