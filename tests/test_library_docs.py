"""docs/library.md: every python block runs as it stands (a run folder for snippet 3 is synthetic)."""

import os
import re
import subprocess
import sys

import pytest

from tests.synthetic_run import write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks():
    text = open(os.path.join(ROOT, "docs", "library.md")).read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_page_has_three_snippets():
    assert len(_blocks()) == 3


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2])
def test_snippet_runs(index, tmp_path):
    code = _blocks()[index]
    # each block runs from a project-root-like folder: the shipped model, and runs/textcraft_tiny (the README's main job) for snippet 3
    os.makedirs(tmp_path / "bipace_jax" / "data")
    os.symlink(
        os.path.join(ROOT, "bipace_jax", "data", "textcraft_tiny"), tmp_path / "bipace_jax" / "data" / "textcraft_tiny"
    )
    write_run(tmp_path / "runs" / "textcraft_tiny")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
