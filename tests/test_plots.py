"""plots.make_plots on a synthetic run folder: the files, and the numbers behind them (each figure's data)."""

import json
import os

import pytest

from bipace_jax import metrics, plots, stats
from tests.synthetic_run import GROUP_SIZE, TASKS, records, write_run

PNG = b"\x89PNG\r\n\x1a\n"


def test_wilson_interval_matches_a_hand_value():
    # 7 of 10 at z = 1.96: centre 0.89208 / 1.38416 = 0.644492, half 1.96 / 1.38416 * sqrt(0.021 + 0.009604)
    # = 0.247719 (the published 95% Wilson interval of 7/10 is 0.3968..0.8922)
    lo, hi = stats.wilson(7, 10)
    assert lo == pytest.approx(0.396773, abs=1e-5) and hi == pytest.approx(0.892211, abs=1e-5)
    assert stats.wilson(0, 20)[0] == 0.0 and stats.wilson(20, 20)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        stats.wilson(3, 0)


def test_validation_points_sit_at_iterations_completed_with_their_games(tmp_path):
    rows = write_run(tmp_path / "run")
    pts = metrics.validation_points(rows, "val", GROUP_SIZE)
    assert [p[0] for p in pts] == [0, 2, 4, 6]  # before RL, then after iterations 1, 3, 5 (0-based)
    x, v, lo, hi, n = pts[-1]
    assert n == TASKS * GROUP_SIZE and v == pytest.approx(rows[-1]["val/success_rate"])
    assert (lo, hi) == pytest.approx(stats.wilson(v * n, n))
    assert metrics.series(rows, "train/success_rate")[0] == [0, 1, 2, 3, 4, 5]


def test_make_plots_writes_every_plot_as_png(tmp_path):
    write_run(tmp_path / "run")
    paths = plots.make_plots(str(tmp_path / "run"))
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


def _grpo_rows(num_iterations):
    """A GRPO run's records: no PACE or leave-one-out rows, one epsilon, no calibration sweep."""
    rows = records(num_iterations)
    for r in rows:
        r.update({"estimator/pace_row_rate": 0.0, "estimator/loo_row_rate": 0.0})
        for k in [k for k in r if k.startswith("estimator/calibration_singleton_rate/")]:
            del r[k]
    return rows


def test_a_grpo_run_gets_no_pace_mix_and_no_calibration_plot(tmp_path):
    write_run(tmp_path / "run")
    run = plots.Run(_grpo_rows(6), GROUP_SIZE)
    assert plots.pace_row_mix(run) is None and plots.calibration(run) is None
    paths = plots.make_plots(str(tmp_path / "run"), _grpo_rows(6))
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "success.png",
        "singleton_rate.png",
        "training.png",
        "time.png",
        "categories.png",
    ]
    # a BiPACE run's mix: the stacked bars are the recorded shares (0.6 PACE, 0.3 LOO, 0.1 singleton)
    fig = plots.pace_row_mix(plots.Run(records(3), GROUP_SIZE))
    bars = fig.axes[0].patches
    assert [round(b.get_height(), 6) for b in bars] == [0.6] * 3 + [0.3] * 3 + [0.1] * 3
    assert [round(b.get_y(), 6) for b in bars[3:6]] == [0.6] * 3 and bars[0].get_x() + 0.4 == pytest.approx(0)


def test_a_one_iteration_run_draws_its_points_with_markers():
    run = plots.Run(records(1), GROUP_SIZE)
    (train,) = [ln for ln in plots.success(run).axes[0].lines if ln.get_label().startswith("train")]
    assert train.get_marker() == "o" and list(train.get_xdata()) == [0]
    lines = plots.singleton_rate(run).axes[0].lines
    assert [ln.get_marker() for ln in lines] == ["o", "o"] and [list(ln.get_ydata()) for ln in lines] == [[0.6], [0.2]]
    assert all(ln.get_marker() == "o" for ax in plots.training(run).axes for ln in ax.lines)
    # a long run keeps plain lines
    long = plots.Run(records(20))  # no group size: no intervals (the synthetic rates pass 1 by then)
    (train,) = [ln for ln in plots.success(long).axes[0].lines if ln.get_label().startswith("train")]
    assert train.get_marker() in (None, "None")


def test_time_plot_stacks_the_before_rl_validation_on_iteration_0():
    rows = records(2)
    rows[0]["val_before/validation_s"] = 7.0
    ax = plots.time_phases(plots.Run(rows, GROUP_SIZE)).axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert labels[0] == "validation before RL"
    (first,) = [c for c in ax.containers if c.get_label() == "validation before RL"]
    assert [b.get_height() for b in first] == [7.0, 0.0] and [b.get_y() for b in first] == [0.0, 0.0]
    # iteration 0's stack: 7 (before RL) + 10 rollout + 2 old + 0 ref + 0.5 estimator + update
    top = max(b.get_y() + b.get_height() for c in ax.containers for b in c if b.get_x() < 0.5)
    assert top == pytest.approx(7.0 + 10.0 + 2.0 + 0.5 + rows[0]["time/update_s"])


def test_calibration_ticks_name_epsilon_itself_and_whole_iterations():
    rows = records(2)  # a sweep at 0.01, 0.02, 0.05 and two iterations at epsilon 0.05
    fig = plots.calibration(plots.Run(rows, GROUP_SIZE, target_singleton_rate=0.25))
    fig.canvas.draw()
    ax, bar = fig.axes
    assert ax.xaxis.get_major_formatter().get_offset() == ""
    ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_xticklabels() if t.get_text()]
    # epsilon ticks, not whole numbers (the iteration axis' integer locator put one tick, 0, under 0.01..0.05)
    assert len([t for t in ticks if 0.01 <= t <= 0.05]) >= 3 and len(ticks) <= 8
    assert [float(t) for t in bar.get_yticks() if 0 <= t <= 1] == [0.0, 1.0]  # iterations 0 and 1, no 0.2 steps
    one = plots.calibration(plots.Run(records(1), GROUP_SIZE))  # one iteration: one tick, 0 (was -0.1 .. 0.1)
    one.canvas.draw()
    assert list(one.axes[1].get_yticks()) == [0.0]
    ax = plots.time_phases(plots.Run(records(1), GROUP_SIZE)).axes[0]
    ax.figure.canvas.draw()
    assert 0.0 in ax.get_xticks() and all(float(t).is_integer() for t in ax.get_xticks())  # (was -0.4 .. 0.4)
    # a controller that moved epsilon (no sweep) still draws the relation
    moved = _grpo_rows(3)
    for r, e in zip(moved, (0.05, 0.06, 0.07)):
        r["estimator/epsilon"] = e
    assert plots.calibration(plots.Run(moved, GROUP_SIZE)) is not None
