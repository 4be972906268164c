"""The step-time table of the committed AOT reports, the rollout under both schedulers, without compiling.

    python -m launch.step_table                     # benchmarks/aot/*.json -> table + benchmarks/step_time.json

Each report under ``--reports`` that has a ``step_time`` section gives its ``RunShape`` (the shapes the
compile used); the model's sizes come from its preset (``Qwen2Config.preset``), the sampler's row
buckets and ``rollout.chunk_steps`` from its config file (``configs/<config>.py``). Then
`step_time.estimate` runs again (analytic, under a second a report): the iteration at the config's
bounds as committed, and the rollout with drawn response lengths under lockstep and continuous
scheduling (`step_time.rollout_model`). Two continuous rows: inserts padded to ``sampler.batch_buckets``
(what ``SlotSampler.insert`` does today) and inserts at power-of-two row buckets (1, 2, 4, ...: the
design note's n-buckets), the what-if. Prints a markdown table; writes JSON to ``--out``, headline
ratios under ``speedup_*`` keys.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import os

from absl import app, flags

from bipace_jax import step_time
from bipace_jax.models import Qwen2Config
from launch import cli
from launch._common import ROOT, write_json

_REPORTS = flags.DEFINE_string("reports", os.path.join(ROOT, "benchmarks", "aot"), "Folder of AOT reports.")
_OUT = flags.DEFINE_string("out", os.path.join(ROOT, "benchmarks", "step_time.json"), "JSON report path.")


def run_shape(report: dict) -> step_time.RunShape:
    """The report's ``RunShape`` with the config's sampler buckets and chunk steps (older reports lack them).

    Raises:
      ValueError: the report has no ``step_time`` section.
    """
    if "step_time" not in report:
        raise ValueError(f"report of {report.get('config')!r} has no step_time section (a CPU or warm-start report)")
    c = importlib.import_module(f"configs.{report['config']}").get_config()
    fields = {f.name for f in dataclasses.fields(step_time.RunShape)}
    shape = {k: v for k, v in report["step_time"]["run_shape"].items() if k in fields}
    shape.update(
        batch_buckets=tuple(c.sampler.batch_buckets),
        insert_buckets=tuple(shape.get("insert_buckets", ())),
        chunk_steps=int(c.rollout.chunk_steps),
    )
    return step_time.RunShape(**shape)


def powers_of_two(up_to: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= ``up_to``."""
    out = [1]
    while out[-1] < up_to:
        out.append(out[-1] * 2)
    return tuple(out)


def rows(reports_dir: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(reports_dir, "*.json"))):
        with open(path) as f:
            report = json.load(f)
        if "step_time" not in report:
            continue
        shape = run_shape(report)
        m = step_time.ModelShape.of(Qwen2Config.preset(report["model"]["preset"]))
        chip = step_time.chip_for(report["device_kind"])
        e = step_time.estimate(m, shape, chip)
        exact = step_time.estimate(
            m, dataclasses.replace(shape, insert_buckets=powers_of_two(max(shape.batch_buckets))), chip
        )
        slices = report.get("num_slices", 1)
        out.append(
            dict(
                report=os.path.basename(path),
                config=report["config"],
                slice=f"{slices} x {report['topology']}" if slices > 1 else report["topology"],
                chips=report["chips"],
                hosts=report["hosts"],
                games_per_host=shape.games_per_host,
                batch_buckets=list(shape.batch_buckets),
                iteration_s_bound=e["iteration_s"],
                committed_iteration_s=report["step_time"]["iteration_s"],
                rollout_s_bound=e["stages_s"]["rollout"],
                rollout_s_lockstep=e["rollout_s_lockstep"],
                rollout_s_continuous=e["rollout_s_continuous"],
                rollout_s_continuous_exact_inserts=exact["rollout_s_continuous"],
                speedup_continuous_rollout=e["speedup_continuous_rollout"],
                speedup_continuous_rollout_exact_inserts=exact["speedup_continuous_rollout"],
                iteration_s_lockstep=e["iteration_s_lockstep"],
                iteration_s_continuous=e["iteration_s_continuous"],
                iteration_s_continuous_exact_inserts=exact["iteration_s_continuous"],
                run_hours_lockstep=e["run_hours_lockstep"],
                run_hours_continuous=e["run_hours_continuous"],
                run_hours_continuous_exact_inserts=exact["run_hours_continuous"],
                decode_steps_lockstep=e["schedulers"]["rollout"]["lockstep"]["decode_steps"],
                decode_steps_continuous=e["schedulers"]["rollout"]["continuous"]["decode_steps"],
                speedup_decode_steps=e["schedulers"]["rollout"]["speedup_decode_steps"],
                prefill_s_lockstep=e["schedulers"]["rollout"]["lockstep"]["stages_s"]["prefill"],
                prefill_s_continuous=e["schedulers"]["rollout"]["continuous"]["stages_s"]["prefill"],
                prefill_s_continuous_exact_inserts=exact["schedulers"]["rollout"]["continuous"]["stages_s"]["prefill"],
                unit_costs_s=e["schedulers"]["rollout"]["unit_costs_s"],
                run_shape=dataclasses.asdict(shape),
            )
        )
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    table = rows(_REPORTS.value)
    print(
        "| config | slice | games/host | rollout s: bound / lockstep / continuous / continuous, exact inserts "
        "| decode steps lockstep / continuous | iteration s: lockstep / continuous / exact | 150 it. h: lockstep / continuous / exact |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['config']} | {r['slice']} | {r['games_per_host']} | {r['rollout_s_bound']:.0f} / "
            f"{r['rollout_s_lockstep']:.0f} / {r['rollout_s_continuous']:.0f} / {r['rollout_s_continuous_exact_inserts']:.0f} "
            f"({r['speedup_continuous_rollout']:.2f}x, {r['speedup_continuous_rollout_exact_inserts']:.2f}x) | "
            f"{r['decode_steps_lockstep']:.0f} / {r['decode_steps_continuous']:.0f} ({r['speedup_decode_steps']:.2f}x) | "
            f"{r['iteration_s_lockstep']:.0f} / {r['iteration_s_continuous']:.0f} / {r['iteration_s_continuous_exact_inserts']:.0f} | "
            f"{r['run_hours_lockstep']:.1f} / {r['run_hours_continuous']:.1f} / {r['run_hours_continuous_exact_inserts']:.1f} |"
        )
    write_json(
        _OUT.value,
        dict(
            method="launch.step_table: step_time.estimate on the committed AOT reports' shapes (no compile); "
            "rollout with lognormal responses (step_time.rollout_model, bipace_jax.schedule_sim)",
            rows=table,
        ),
        indent=1,
    )


if __name__ == "__main__":
    cli.run(main)
