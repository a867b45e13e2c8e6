"""The layers of `shared/` point one way (docs/design.md, "Layers").

Every module's imports are read with `ast` (those inside functions and under `TYPE_CHECKING`
too): no two modules of the project's packages (`PACKAGES`) may reach each other through imports,
and a module of `shared` may import only modules of its own layer or of a layer below it. Run on
another checkout with `python tests/test_layers.py PATH` (it prints what breaks the rules and
exits 1).
"""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "services", "tools", "bench", "distill", "kernels", "tests")

# Bottom first. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("shared.errors", "shared.settings", "shared.text")),
    ("values", ("shared.values", "shared.grammar")),
    ("scheduling", ("shared.scheduling",)),
    ("model", ("shared.model",)),
    ("engine", ("shared.engine",)),
    ("wire", ("shared.wire",)),
    ("bus", ("shared.bus",)),
    ("tools", ("shared.cli", "shared.datasets")),
)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The index of `module`'s layer (None for the `shared` package itself)."""
    named = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not named:
        if module == "shared":
            return None
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(named)[1]


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The modules of `shared` an import statement names (`from pkg import sub` names pkg.sub
    where sub is a module; the caller keeps only names that are modules)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def import_graph(root: Path, packages: tuple[str, ...] = ("shared",)) -> dict[str, set[str]]:
    """Each module of `root`'s `packages` -> the modules of those packages it imports."""
    files = {
        module_name(root, p): p
        for package in packages
        for p in sorted((root / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _targets(node, module, path.name == "__init__.py"):
                    # the named module, else the nearest enclosing package that is one
                    while name and name not in files:
                        name = name.rpartition(".")[0]
                    if name and name != module:
                        imported.add(name)
        graph[module] = imported
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, imported in sorted(graph.items()):
        here = layer_of(module)
        for name in sorted(imported):
            there = layer_of(name)
            if here is not None and there is not None and there > here:
                out.append(f"{module} ({LAYERS[here][0]}) imports {name} ({LAYERS[there][0]})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle among the modules, one per strongly connected group."""
    found: list[list[str]] = []
    remaining = {m: set(deps) for m, deps in graph.items()}
    while True:
        try:
            graphlib.TopologicalSorter(remaining).prepare()
            return found
        except graphlib.CycleError as e:
            cycle = e.args[1]
            found.append(cycle)
            a, b = cycle[-2], cycle[-1]  # break the cycle at one edge, look for the next
            remaining[a].discard(b)
            remaining[b].discard(a)


def problems(root: Path) -> list[str]:
    loops = cycles(import_graph(root, PACKAGES))
    return upward_imports(import_graph(root)) + [" -> ".join(c) + " (a cycle)" for c in loops]


def test_every_module_of_shared_has_a_layer():
    for module in import_graph(REPO):
        layer_of(module)


def test_no_module_imports_one_above_it():
    assert upward_imports(import_graph(REPO)) == []


def test_no_import_cycles():
    assert cycles(import_graph(REPO, PACKAGES)) == []


def test_the_check_sees_a_cycle_and_an_upward_import():
    graph = {"shared.values.tree": {"shared.scheduling.core"}, "shared.scheduling.core": set()}
    assert upward_imports(graph) == [
        "shared.values.tree (values) imports shared.scheduling.core (scheduling)"
    ]
    graph = {
        "shared.scheduling.a": {"shared.scheduling.b"},
        "shared.scheduling.b": {"shared.scheduling.a"},
    }
    assert len(cycles(graph)) == 1


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    print("\n".join(found) or "the layers hold")
    sys.exit(1 if found else 0)


def package_imports(root: Path, below: str, above: tuple[str, ...]) -> list[str]:
    """The imports by `below`'s modules of modules in the `above` packages."""
    graph = import_graph(root, (below, *above))
    return [
        f"{module} imports {name}"
        for module, imported in sorted(graph.items())
        if module.split(".")[0] == below
        for name in sorted(imported)
        if name.split(".")[0] in above
    ]


def test_the_product_never_imports_the_lab():
    """services and shared run without tools/ and bench/; tools (what operators run) without
    bench/ (the lab's experiments)."""
    assert package_imports(REPO, "shared", ("services", "tools", "bench")) == []
    assert package_imports(REPO, "services", ("tools", "bench")) == []
    assert package_imports(REPO, "tools", ("bench",)) == []
