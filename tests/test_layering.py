"""The package's layering, read from its source: the modules of `jaxpage` and
`pallas_kernels` import one another without a circle, and each layer imports only what is
below it:

    pallas_kernels        the kernels and their JAX wrappers; nothing of jaxpage
    jaxpage.layers        which implementation each op gets; no model, loader or engine
    jaxpage.models        the model families, written against jaxpage.layers; no kernel, no
                          file format (the loaders convert checkpoints to their params)
    jaxpage.engine.engine the host engine, asking its scheduler (not the allocator's modules)
                          what a request needs

Imports are parsed with `ast`, those inside functions and `if TYPE_CHECKING:` blocks too (a
lazy import still ties two modules together), so nothing is imported to check them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpage", "pallas_kernels")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its file, for every module under the packages (a package by its
    __init__.py)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name the module's imports name, wherever in it they are: `import a.b`
    gives a.b, `from a.b import c` a.b.c (c a module or an attribute of a.b); relative
    imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules (among `files`) it imports."""
    graph = {}
    for name, path in files.items():
        edges = set()
        for imported in imported_names(name, path):
            # a.b.c: the module a.b.c where there is one, else a.b (c is its attribute)
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted: every set of modules that import one another in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def forbidden_imports(files: dict[str, Path], importer: str, forbidden: tuple[str, ...]
                      ) -> list[str]:
    """'module -> name' for each import, by a module `importer` names (itself or one under it),
    of a name `forbidden` names (one of them or under it)."""
    def within(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return sorted(f"{name} -> {imported}" for name, path in files.items()
                  if within(name, (importer,))
                  for imported in imported_names(name, path) if within(imported, forbidden))


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    return module_files(ROOT)


def test_the_parse_sees_the_packages(files):
    """A positive control: the modules and edges the rules below are about are there."""
    graph = import_graph(files)
    assert {"jaxpage.models.llama", "jaxpage.layers", "jaxpage.engine.engine",
            "pallas_kernels.cpu_ops"} <= set(graph)
    assert "jaxpage.layers" in graph["jaxpage.models.llama"]
    assert "pallas_kernels.cpu_ops" in graph["jaxpage.layers.linear"]
    assert "jaxpage.engine.scheduler" in graph["jaxpage.engine.engine"]
    # an import inside a function counts: the engine builds its runner lazily
    assert "jaxpage.engine.runner" in graph["jaxpage.engine.engine"]


def test_no_import_circle(files):
    assert circles(import_graph(files)) == []


def test_model_families_import_no_kernel_and_no_loader(files):
    assert forbidden_imports(files, "jaxpage.models",
                             ("pallas_kernels", "jaxpage.loading")) == []


def test_layers_import_no_model_loader_or_engine(files):
    assert forbidden_imports(files, "jaxpage.layers",
                             ("jaxpage.models", "jaxpage.loading", "jaxpage.engine")) == []


def test_the_engine_asks_the_scheduler_not_the_allocators_modules(files):
    assert forbidden_imports(files, "jaxpage.engine.engine",
                             ("jaxpage.engine.block_hashing", "jaxpage.engine.kv_groups")) == []


def test_kernels_import_nothing_of_jaxpage(files):
    assert forbidden_imports(files, "pallas_kernels", ("jaxpage",)) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """Negative controls: a made-up graph's circle is found, and so is one a made-up package
    closes with an import inside a function, and a forbidden import in it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}, "f": {"g"},
             "g": {"f"}}
    assert circles(graph) == [["a", "b", "c"], ["f", "g"]]
    assert circles({"a": {"b"}, "b": set()}) == []

    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import low\n")
    (package / "sub" / "low.py").write_text("def f():\n    from ..top import g\n    return g\n")
    (package / "top.py").write_text("from pkg.sub.low import f\nimport os\n\ndef g():\n"
                                    "    return f\n")
    made_up = module_files(tmp_path, ("pkg",))
    assert set(made_up) == {"pkg", "pkg.sub", "pkg.sub.low", "pkg.top"}
    assert circles(import_graph(made_up)) == [["pkg.sub.low", "pkg.top"]]
    assert forbidden_imports(made_up, "pkg.sub", ("pkg.top",)) == ["pkg.sub.low -> pkg.top.g"]
