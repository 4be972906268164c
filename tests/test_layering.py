"""The import layering of docs/architecture.md: data flows one way, and no module imports itself back.

Package rules: nothing in ``bipace_jax`` imports ``configs`` or ``launch``; nothing in ``environments``
imports ``bipace_jax``, ``configs`` or ``launch``; ``configs`` never imports ``launch``. Module order
inside ``bipace_jax``: ``LAYERS`` below, bottom first, is the numbered list of docs/architecture.md
(a test checks that they agree); a module imports only modules of its own layer and of layers below,
and ``NEVER`` adds the rules between neighbours that the order alone allows (learning beside rollout).
The module graph of the project (every import statement, at module level or inside a function) has no
cycle, and a project library module is never imported inside a function (lazy imports hid cycles).
"""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("bipace_jax", "environments", "configs", "launch")
FORBIDDEN = {
    "bipace_jax": {"configs", "launch"},
    "environments": {"bipace_jax", "configs", "launch"},
    "configs": {"launch"},
    "launch": set(),
}

# The order inside bipace_jax, bottom first: (layer name, modules). A name covers a package's
# submodules too ("bipace_jax.models" is every module under bipace_jax/models/). A new library module
# gets a line here and in docs/architecture.md's list (test_every_library_module_has_a_layer says which).
LAYERS = (
    ("checks", ("bipace_jax.config", "bipace_jax.buckets")),
    (
        "base",
        (
            "bipace_jax.sharding",
            "bipace_jax.tasks",
            "bipace_jax.distributed",
            "bipace_jax.async_rl",
            "bipace_jax.runfolder",
            "bipace_jax.loglines",
            "bipace_jax.transcripts",
            "bipace_jax.resume",
            "bipace_jax.checkpointing",
            "bipace_jax.metric_keys",
            "bipace_jax.stats",
            "bipace_jax.metrics",
            "bipace_jax.plots",
            "bipace_jax.programs",
        ),
    ),
    ("models", ("bipace_jax.models",)),
    ("estimators", ("bipace_jax.estimators",)),
    ("sampling", ("bipace_jax.sampling",)),
    ("batch", ("bipace_jax.batch",)),
    ("rollout", ("bipace_jax.rollout",)),
    # the run's sizes and speed: the simulation drives the rollout loop itself, the plan prices its
    # shapes with the step-time model; the learner and the top layer read them
    ("perf", ("bipace_jax.schedule_sim", "bipace_jax.step_time", "bipace_jax.plan")),
    ("learning", ("bipace_jax.losses", "bipace_jax.learner", "bipace_jax.ppo")),
    (
        "top",
        (
            "bipace_jax",
            "bipace_jax.build",
            "bipace_jax.tiny",
            "bipace_jax.demos",
            "bipace_jax.demo_stream",
            "bipace_jax.sft",
            "bipace_jax.trainer",
            "bipace_jax.async_processes",
            "bipace_jax.validation",
            "bipace_jax.lab",
            "bipace_jax.aot",
        ),
    ),
)
# Layers the order puts below a module that it still must not import: (importer layer, imported layer).
NEVER = (("learning", "rollout"),)


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


def _layer_of(module: str) -> int | None:
    """Index in LAYERS of a bipace_jax module (its most specific entry), or None if no entry covers it."""
    best, best_len = None, -1
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            # the package's own __init__ is listed exactly; other entries also cover their submodules
            covers = module == n or (n != "bipace_jax" and module.startswith(n + "."))
            if covers and len(n) > best_len:
                best, best_len = i, len(n)
    return best


def _order_violations(graph, skip=()) -> list[str]:
    """Imports of a bipace_jax module from a higher layer, or from a layer that NEVER forbids, as
    'module:line imports target (layer a -> layer b)'; edges matched by ``skip`` ((module, target)
    keys, target "*" = any) are left out."""
    names = [n for n, _ in LAYERS]
    never = {(names.index(a), names.index(b)) for a, b in NEVER}
    bad = []
    for m, deps in graph.items():
        lm = _layer_of(m)
        for t, _, line in deps:
            lt = _layer_of(t)
            if lm is None or lt is None or (m, "*") in skip or (m, t) in skip:
                continue
            if lt > lm or (lm, lt) in never:
                bad.append(f"{m}:{line} imports {t} (layer {names[lm]} -> layer {names[lt]})")
    return bad


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


def test_every_library_module_has_a_layer():
    missing = sorted(m for m in MODULES if m.split(".")[0] == "bipace_jax" and _layer_of(m) is None)
    assert not missing, f"give these a layer in LAYERS and in docs/architecture.md's list: {missing}"


def test_library_modules_import_only_their_own_layer_and_below():
    bad = _order_violations(GRAPH)
    assert not bad, "\n".join(bad)


def test_the_order_check_sees_planted_violations(tmp_path):
    # Sampling importing rollout, an estimator importing the learner, config importing models (the
    # order) and ppo importing rollout (NEVER) are each reported; rollout importing sampling is not.
    planted = {
        "bipace_jax.sampling": "from bipace_jax.rollout import collect\n",
        "bipace_jax.estimators.core": "from bipace_jax import ppo\n",
        "bipace_jax.config": "import os\n\nfrom bipace_jax.models import Qwen2Config\n",
        "bipace_jax.ppo": "from bipace_jax import losses\nfrom bipace_jax.rollout import TokenBatch\n",
        "bipace_jax.rollout": "from bipace_jax.sampling import Engine\nfrom bipace_jax.estimators import StepBatch\n",
    }
    graph = {}
    for m, text in planted.items():
        p = tmp_path / f"{m}.py"
        p.write_text(text)
        graph[m] = _imports(m, str(p))
    assert sorted(_order_violations(graph)) == [
        "bipace_jax.config:3 imports bipace_jax.models (layer checks -> layer models)",
        "bipace_jax.estimators.core:1 imports bipace_jax.ppo (layer estimators -> layer learning)",
        "bipace_jax.ppo:2 imports bipace_jax.rollout (layer learning -> layer rollout)",
        "bipace_jax.sampling:1 imports bipace_jax.rollout (layer sampling -> layer rollout)",
    ]
    # a skip table leaves out exactly its edges
    skip = {("bipace_jax.config", "*"): "", ("bipace_jax.ppo", "bipace_jax.rollout"): ""}
    assert sorted(_order_violations(graph, skip=skip)) == [
        "bipace_jax.estimators.core:1 imports bipace_jax.ppo (layer estimators -> layer learning)",
        "bipace_jax.sampling:1 imports bipace_jax.rollout (layer sampling -> layer rollout)",
    ]


def test_layers_are_the_numbered_list_of_docs_architecture():
    # The doc's list, one item per layer in LAYERS' order, names every module of its layer.
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    items = re.findall(r"^\d+\. \*\*(\w+)\*\*(.*?)(?=^\d+\. |^#|\Z)", text, flags=re.M | re.S)
    doc = [(name, body) for name, body in items if name in dict(LAYERS)]
    assert [n for n, _ in doc] == [n for n, _ in LAYERS], [n for n, _ in items]
    for (name, body), (_, modules) in zip(doc, LAYERS):
        for m in modules:
            path = m.replace(".", "/")
            named = f"`{path}.py`" in body or f"`{path}/`" in body or f"`{m}`" in body
            named = named or f"`{path.rpartition('/')[2]}.py`" in body or f"`{path.rpartition('/')[2]}/`" in body
            assert named, f"docs/architecture.md's item {name!r} does not name {m}"


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
