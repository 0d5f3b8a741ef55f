"""The layout's promises, checked on the source: who may import whom, and no import cycles.

The request path's stages live in folders: `retrieval/` (search) → `app/catalog/` (rows) →
`app/store/` (KV tiers) → `app/kvcache/` (joins catalog, store and engine) → `engine/`
(prefill, decode). The engine computes and knows nothing of the catalog, the store or HTTP;
retrieval knows nothing of the application. Only module-level imports count: an import
inside a function is a deliberate late binding (start-up cost, optional dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine", "retrieval", "migrations", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = REPO / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def top_level_imports(path: Path) -> set[str]:
    """Modules of this project that `path` imports at module level (not inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import submodule` imports the submodule; any other name comes from pkg
            # itself
            for alias in node.names:
                found.add(
                    f"{node.module}.{alias.name}"
                    if is_module(f"{node.module}.{alias.name}")
                    else node.module
                )
    return {name for name in found if name.split(".")[0] in PACKAGES}


def source_modules() -> dict[str, set[str]]:
    graph = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "versions" not in path.parts:
                graph[module_name(path)] = top_level_imports(path)
    return {name: {m for m in deps if m in graph} for name, deps in graph.items()}


def all_imports(package: str) -> dict[str, set[str]]:
    """Every import of this project's packages anywhere in `package` (function bodies too)."""
    out = {}
    for path in (REPO / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {
            n.module
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
        }
        out[module_name(path)] = {n for n in names if n.split(".")[0] in PACKAGES}
    return out


def test_the_engine_imports_neither_the_application_nor_retrieval():
    offenders = {
        m: sorted(d for d in deps if d.split(".")[0] in ("app", "retrieval", "migrations"))
        for m, deps in all_imports("engine").items()
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_no_client_of_the_engine_lives_inside_it():
    # what prefills through `Engine` (the variant policy's builds, a benchmark) sits above it
    clients = sorted(
        m for m, deps in all_imports("engine").items() if m != "engine" and "engine.engine" in deps
    )
    assert clients == []


def test_retrieval_does_not_import_the_application():
    offenders = {
        m: sorted(d for d in deps if d.split(".")[0] in ("app", "migrations"))
        for m, deps in all_imports("retrieval").items()
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_store_knows_nothing_of_the_catalog_or_the_service():
    offenders = {
        m: sorted(
            d for d in deps if d.startswith(("app.catalog", "app.kvcache", "app.rag", "app.api"))
        )
        for m, deps in all_imports("app").items()
        if m.startswith("app.store")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def folder_graph() -> dict[str, set[str]]:
    """Module-level imports between folders: `engine.planners.cachecraft` importing
    `engine.cachecraft.choice` is the edge engine.planners → engine.cachecraft. A module right
    under a top-level package (`engine.model.runner`) is a node of its own. Imports inside one
    folder
    (a package's `__init__` registering its modules) are not edges."""
    folders = {
        name
        for name in source_modules()
        if "." in name and (REPO / name.replace(".", "/")).is_dir()
    }

    def folder(module: str) -> str:
        if module in folders or module in PACKAGES:
            return module
        parent = module.rpartition(".")[0]
        return parent if parent in folders else module

    graph: dict[str, set[str]] = {}
    for module, deps in source_modules().items():
        graph.setdefault(folder(module), set()).update({folder(d) for d in deps} - {folder(module)})
    return graph


def test_folders_import_each_other_without_cycles():
    # e.g. engine.cachecraft → engine.planners (for the plan types) while engine.planners →
    # engine.cachecraft (for the formulas) would be a cycle: shared types live below both
    cycles = [c for c in strongly_connected(folder_graph()) if len(c) > 1]
    assert cycles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_cycle():
    # the check above must be able to fail
    found = strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert sorted(found) == [["a", "b", "c"], ["d"]]


def module_graph() -> dict[str, set[str]]:
    """Every import between this project's modules, function bodies included (a lazy import
    still ties two files together); `from pkg import submodule` is an edge to the submodule."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "versions" in path.parts:
                continue
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        sub = f"{node.module}.{alias.name}"
                        found.add(sub if is_module(sub) else node.module)
            graph[module_name(path)] = {m for m in found if m.split(".")[0] in PACKAGES}
    return {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}


def test_no_two_modules_import_each_other_directly_or_in_a_circle():
    # files, not only folders: e.g. bench.cli.bench importing bench.cli.workload while that
    # imports bench.cli.bench back inside a function (shared arguments live in app.cli.common)
    cycles = [c for c in strongly_connected(module_graph()) if len(c) > 1]
    assert cycles == []


def test_the_product_imports_nothing_from_the_benchmarks():
    """`bench/` builds on the product; the product never on it (its commands are plugins)."""
    offenders = {
        module: sorted(d for d in deps if d.split(".")[0] == "bench")
        for package in ("app", "engine", "retrieval", "migrations")
        for module, deps in all_imports(package).items()
    }
    assert {m: d for m, d in offenders.items() if d} == {}
