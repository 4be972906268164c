"""wandb tracking (config.log.wandb): a stand-in module records the calls; real wandb offline when installed."""

import os
import subprocess
import sys
import types

import pytest

from bipace_jax import metrics
from tests.synthetic_run import write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _FakeRun:
    def __init__(self, **kwargs):
        self.init, self.metrics, self.logged, self.finished = kwargs, [], [], False

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

    def log(self, values):
        self.logged.append(dict(values))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []

    def init(**kwargs):
        runs.append(_FakeRun(**kwargs))
        return runs[-1]

    module = types.SimpleNamespace(init=init)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def _log(folder, rows, start=0):
    logger = metrics.MetricsLogger(str(folder), start, config={"seed": 0}, derived={"hosts": 1}, wandb_project="p")
    for r in rows[start:]:
        logger.write(r["iteration"], {k: v for k, v in r.items() if k != "iteration"})
    logger.close()


def test_wandb_gets_every_scalar_at_iterations_completed_and_a_resume_continues_the_run(tmp_path, fake_wandb):
    rows = write_run(tmp_path / "src", num_iterations=2)
    _log(tmp_path / "run", rows)
    (run,) = fake_wandb
    run_id = open(tmp_path / "run" / "wandb_id").read()
    assert run.init["project"] == "p" and run.init["id"] == run_id and run.init["resume"] == "allow"
    assert len(run_id) == 12
    assert run.init["config"] == {"seed": 0, "derived": {"hosts": 1}} and run.init["dir"] == str(tmp_path / "run")
    assert run.metrics == [("iterations_completed", None), ("*", "iterations_completed")]
    steps = [d["iterations_completed"] for d in run.logged]
    assert steps == [0, 1, 2]  # x 0: before-RL validation + iteration 0's batch; 1: iteration 1's; 2: its validation
    assert run.logged[0]["val/success_rate"] == pytest.approx(0.35) and run.logged[0]["train/success_rate"] == 0.3
    assert "val_before/success_rate" not in run.logged[0] and "val/success_rate" not in run.logged[1]
    assert run.logged[2]["val/success_rate"] == pytest.approx(rows[1]["val/success_rate"])
    assert run.logged[1]["train/success_rate"] == pytest.approx(0.4) and run.finished
    # a resumed logger continues the same wandb run; another run folder gets another id
    fake_wandb.clear()
    _log(tmp_path / "run", rows, start=1)
    _log(tmp_path / "other", rows)
    assert fake_wandb[0].init["id"] == run_id and fake_wandb[1].init["id"] != run_id


def test_log_wandb_without_wandb_installed_is_one_config_error(monkeypatch):
    import importlib.util

    from bipace_jax import config as config_lib

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(config_lib.ConfigError, match=r"config\.log\.wandb=True needs wandb: pip install"):
        config_lib.LogConfig(wandb=True)
    with pytest.raises(config_lib.ConfigError, match=r"config\.log\.wandb_project must be a non-empty"):
        config_lib.LogConfig(wandb_project="")


@pytest.mark.slow
def test_real_wandb_offline_writes_a_run_with_no_network(tmp_path):
    pytest.importorskip("wandb")
    rows = write_run(tmp_path / "src", num_iterations=2)
    script = (
        "import sys; from tests.test_tracking import _log; import json;"
        f"rows=[json.loads(l) for l in open({str(tmp_path / 'src' / 'metrics.jsonl')!r})];"
        f"_log({str(tmp_path / 'run')!r}, rows)"
    )
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=os.environ.get("PYTHONPATH", ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [d for d in os.listdir(tmp_path / "run" / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1 and runs[0].endswith(open(tmp_path / "run" / "wandb_id").read())
    files = os.listdir(tmp_path / "run" / "wandb" / runs[0])
    assert any(f.endswith(".wandb") for f in files)
    assert len(rows) == 2
