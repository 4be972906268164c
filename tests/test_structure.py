"""Project structure: test files mirror the library's modules; the data path's functions stay short.

A top-level module ``bipace_jax/x.py`` is tested in ``tests/test_x.py``; a subpackage ``bipace_jax/pkg/``
in ``tests/test_pkg.py`` or ``tests/test_pkg_<module>.py`` files. ``COVERED_ELSEWHERE`` lists the few
modules whose tests live in another module's file, each with where and why; a new module without a
mirroring test file fails here, and so does an entry that a mirroring file has made stale.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "bipace_jax")

COVERED_ELSEWHERE = {
    "async_processes": "test_async_rl.py: its 2-process runs compare with the colocated run that file's fixture plays",
    "batch": "TokenBatch's checks in test_ppo_protocol.py, its rows through the learner in test_ppo.py",
    "build": "test_configs.py builds every config file into a RunSpec and checks each section's errors",
    "checkpointing": "test_trainer_state.py: round trips, half-written and truncated steps, async saves",
    "config": "test_configs.py (one-line field errors) and test_trainer_state.py (selectors, templates)",
    "distributed": "the two-process runs of test_mesh_placement.py, test_ppo_protocol.py and test_learner.py",
    "demo_stream": "test_demos.py reads the demonstration datasets through it (shards, shuffle, resumed state)",
    "metrics": "test_trainer_state.py, test_runfolder.py and test_plots.py (logger, event files, record readers)",
    "resume": "test_cli.py: the field comparison, and a changed-config resume refused in one line",
    "programs": "test_ppo.py and test_aot.py compare the public program specs with what runs",
    "validation": "test_eval.py: launch.eval's panels equal the trainer's before-RL validation; test_trainer_state.py: own-option panels",
    "tasks": "test_trainer_state.py (selectors, schedule, panels) and test_tiny_tasks.py (the shipped set)",
}

# The data path, (file, qualified function): at most MAX_LINES lines each, docstring included.
DATA_PATH = (
    ("rollout/__init__.py", "collect"),
    ("rollout/schedule.py", "run"),
    ("trainer.py", "Trainer.train_iteration"),
    ("ppo.py", "PPOLearner.update"),
    ("sft/loop.py", "_WarmStart.rounds"),
    ("sft/loop.py", "run"),
)
MAX_LINES = 80


def _library_units() -> list[str]:
    """Top-level module names and subpackage names of bipace_jax."""
    units = []
    for entry in sorted(os.listdir(LIB)):
        path = os.path.join(LIB, entry)
        if entry.endswith(".py") and entry != "__init__.py":
            units.append(entry[:-3])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            units.append(entry)
    return units


def _mirrored(unit: str, tests: set[str]) -> bool:
    if os.path.isdir(os.path.join(LIB, unit)):
        return f"test_{unit}.py" in tests or any(t.startswith(f"test_{unit}_") for t in tests)
    return f"test_{unit}.py" in tests


def test_every_library_module_has_a_mirroring_test_file_or_says_where_it_is_tested():
    tests = {f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py")}
    units = _library_units()
    assert {"rollout", "ppo", "models", "estimators"} <= set(units)  # the scan sees the library
    missing = [u for u in units if not _mirrored(u, tests) and u not in COVERED_ELSEWHERE]
    assert not missing, (
        f"library modules without tests/test_<module>.py (add one, or a reason in COVERED_ELSEWHERE): {missing}"
    )
    stale = [u for u in COVERED_ELSEWHERE if u not in units or _mirrored(u, tests)]
    assert not stale, f"COVERED_ELSEWHERE entries that no longer apply (module gone or now mirrored): {stale}"


def _function_lengths(path: str) -> dict[str, int]:
    """Qualified name -> lines (def to last line) of every function and method of a file."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")

    visit(ast.parse(open(path).read(), path), "")
    return out


def test_the_data_paths_functions_stay_under_80_lines():
    lengths = {}
    for file, name in DATA_PATH:
        found = _function_lengths(os.path.join(LIB, file))
        assert name in found, f"{file} has no function {name} (update DATA_PATH)"
        lengths[f"{file}:{name}"] = found[name]
    long = {k: n for k, n in lengths.items() if n > MAX_LINES}
    assert not long, f"data-path functions over {MAX_LINES} lines (cut at a real seam): {long}"


def test_function_lengths_counts_nested_and_method_lines(tmp_path):
    src = "def f():\n    x = 1\n    return x\n\n\nclass C:\n    def g(self):\n        def h():\n            pass\n        return h\n"
    (tmp_path / "case.py").write_text(src)
    assert _function_lengths(str(tmp_path / "case.py")) == {"f": 3, "C.g": 4, "C.g.h": 2}
