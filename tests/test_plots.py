"""metrics.make_plots on a synthetic run folder: the files, and the numbers behind them."""

import json
import os

import pytest

from bipace_jax import metrics
from tests.synthetic_run import GROUP_SIZE, TASKS, write_run

PNG = b"\x89PNG\r\n\x1a\n"


def test_wilson_interval_matches_a_hand_value():
    # 7 of 10 at z = 1.96: centre 0.89208 / 1.38416 = 0.644492, half 1.96 / 1.38416 * sqrt(0.021 + 0.009604)
    # = 0.247719 (the published 95% Wilson interval of 7/10 is 0.3968..0.8922)
    lo, hi = metrics.wilson(7, 10)
    assert lo == pytest.approx(0.396773, abs=1e-5) and hi == pytest.approx(0.892211, abs=1e-5)
    assert metrics.wilson(0, 20)[0] == 0.0 and metrics.wilson(20, 20)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        metrics.wilson(3, 0)


def test_validation_points_sit_at_iterations_completed_with_their_games(tmp_path):
    rows = write_run(tmp_path / "run")
    pts = metrics.validation_points(rows, "val", GROUP_SIZE)
    assert [p[0] for p in pts] == [0, 2, 4, 6]  # before RL, then after iterations 1, 3, 5 (0-based)
    x, v, lo, hi, n = pts[-1]
    assert n == TASKS * GROUP_SIZE and v == pytest.approx(rows[-1]["val/success_rate"])
    assert (lo, hi) == pytest.approx(metrics.wilson(v * n, n))
    assert metrics._series(rows, "train/success_rate")[0] == [0, 1, 2, 3, 4, 5]


def test_make_plots_writes_every_plot_as_png(tmp_path):
    write_run(tmp_path / "run")
    paths = metrics.make_plots(str(tmp_path / "run"))
    names = [p.rsplit("/", 1)[1] for p in paths]
    assert names == [
        "success.png",
        "singleton_rate.png",
        "pace_row_mix.png",
        "training.png",
        "time.png",
        "categories.png",
        "calibration.png",
    ]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == PNG


def _events(folder):
    """(tag, step, value or text) of every summary value in a TensorBoard folder's event files."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(folder)):
        data = open(os.path.join(folder, name), "rb").read()
        pos = 0
        while pos < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 16 + n
            for v in ev.summary.value:
                text = v.tensor.string_val[0].decode() if v.tensor.string_val else None
                out.append((v.tag, ev.step, v.simple_value if text is None else text))
    return out


def test_tensorboard_steps_validation_by_iterations_completed(tmp_path):
    rows = write_run(tmp_path / "src", num_iterations=2)
    logger = metrics.MetricsLogger(
        str(tmp_path / "run"), config={"seed": 0, "val": {"group_size": 4}}, derived={"rows": 8}
    )
    for r in rows:
        logger.write(r["iteration"], {k: v for k, v in r.items() if k != "iteration"})
    logger.close()
    ev = _events(tmp_path / "run" / "tb")
    val = [(step, v) for tag, step, v in ev if tag == "val/success_rate"]
    assert val == [(0, pytest.approx(0.35)), (2, pytest.approx(rows[1]["val/success_rate"]))]
    assert [step for tag, step, _ in ev if tag == "train/success_rate"] == [0, 1]
    assert not any(tag.startswith("val_before/") for tag, _, _ in ev)
    text = next(v for tag, _, v in ev if tag.startswith("config"))
    assert json.loads(text.strip("`\n"))["derived"] == {"rows": 8}
    assert any(tag == "_hparams_/experiment" for tag, _, _ in ev)
    assert [v for tag, _, v in ev if tag == "loss/kl"] == [pytest.approx(0.0), pytest.approx(0.001)]


def test_a_resume_redraws_the_kept_validation_its_purge_would_drop(tmp_path):
    # the restart purges steps >= start_iteration; the kept validation after iteration 1 sits at step 2
    rows = write_run(tmp_path / "src", num_iterations=2)
    logger = metrics.MetricsLogger(str(tmp_path / "run"))
    for r in rows:
        logger.write(r["iteration"], {k: v for k, v in r.items() if k != "iteration"})
    logger.close()
    before = set(os.listdir(tmp_path / "run" / "tb"))
    metrics.MetricsLogger(str(tmp_path / "run"), start_iteration=2).close()
    (new,) = set(os.listdir(tmp_path / "run" / "tb")) - before
    os.makedirs(tmp_path / "new")
    os.rename(tmp_path / "run" / "tb" / new, tmp_path / "new" / new)
    redrawn = {(tag, step) for tag, step, _ in _events(tmp_path / "new")}
    assert ("val/success_rate", 2) in redrawn and ("train/success_rate", 1) not in redrawn
