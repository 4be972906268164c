"""The import layering of docs/architecture.md: data flows one way, and no module imports itself back.

Rules: nothing in ``bipace_jax`` imports ``configs`` or ``launch``; nothing in ``environments`` imports
``bipace_jax``, ``configs`` or ``launch``; ``configs`` never imports ``launch``; the module graph of the
project (every import statement, at module level or inside a function) has no cycle; and a project
library module is never imported inside a function (lazy imports hid the cycles this test now forbids).
No library module is over 800 lines, and `trainer.py` is at most 500.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("bipace_jax", "environments", "configs", "launch")
FORBIDDEN = {
    "bipace_jax": {"configs", "launch"},
    "environments": {"bipace_jax", "configs", "launch"},
    "configs": {"launch"},
    "launch": set(),
}


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                    out[name] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> list[tuple[str, bool, int]]:
    """(imported project module, inside a function?, line) for every import statement of a module."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".")
                    parts = parts if is_pkg else parts[:-1]
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule when one exists.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
            for t in targets:
                while t and t not in MODULES:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.append((t, f, child.lineno))
            visit(child, f)

    visit(tree, False)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_lower_layers_never_import_higher_ones(package):
    bad = [
        f"{m}:{line} imports {t}"
        for m, deps in GRAPH.items()
        if m.split(".")[0] == package
        for t, _, line in deps
        if t.split(".")[0] in FORBIDDEN[package]
    ]
    assert not bad, "\n".join(bad)


def test_no_library_module_imports_a_project_module_inside_a_function():
    # Entry points (launch/) may defer imports until their flags are parsed; the library may not.
    bad = [
        f"{m}:{line} imports {t} inside a function"
        for m, deps in GRAPH.items()
        if not m.startswith("launch")
        for t, f, line in deps
        if f
    ]
    assert not bad, "\n".join(bad)


def test_the_module_graph_has_no_cycle():
    edges = {m: sorted({t for t, _, _ in deps}) for m, deps in GRAPH.items()}
    state, stack, cycles = {}, [], []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_planted_violation(tmp_path):
    # The rules above are only as good as the import parser: it must resolve relative and ``from``
    # imports to project modules.
    p = tmp_path / "mod.py"
    p.write_text("from . import trainer\nfrom bipace_jax.estimators import gigpo\ndef f():\n    import configs.base\n")
    deps = _imports("bipace_jax.x", str(p))
    assert ("bipace_jax.trainer", False, 1) in deps and ("bipace_jax.estimators.gigpo", False, 2) in deps
    assert ("configs.base", True, 4) in deps


def test_library_modules_stay_readable_in_one_sitting():
    # Issue 11's size limits: no library file over 800 lines, the trainer loop at most 500.
    sizes = {m: sum(1 for _ in open(p)) for m, p in MODULES.items() if m.startswith("bipace_jax")}
    assert sizes["bipace_jax.trainer"] <= 500, sizes["bipace_jax.trainer"]
    assert not {m: n for m, n in sizes.items() if n > 800}
