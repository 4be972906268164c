"""The step-time table of the committed AOT reports, the rollout under both schedulers, without compiling.

    python -m launch.step_table                     # benchmarks/aot/*.json -> table + benchmarks/step_time.json

Each report under ``--reports`` that has a ``step_time`` section gives its ``RunShape`` (the shapes the
compile used); the model's sizes come from its preset (``Qwen2Config.preset``), the sampler's row
buckets and ``rollout.chunk_steps`` from its config file (``configs/<config>.py``). Then
`step_time.estimate` runs again (analytic, under a second a report): the iteration at the config's
bounds as committed, and the rollout with drawn response lengths under lockstep and continuous
scheduling (`step_time.rollout_model`). Two continuous rows: inserts padded to ``sampler.batch_buckets``
(what ``SlotHandle.insert`` does today) and inserts at power-of-two row buckets (1, 2, 4, ...: the
design note's n-buckets), the what-if. Prints a markdown table; writes JSON to ``--out``, headline
ratios under ``speedup_*`` keys.

Shared prompt heads (``sampler.shared_head_tokens``; lockstep only): each game's head and suffix
lengths come from ``--heads`` (``launch.head_lengths``: turns 3 and later, Qwen2.5 tokens), its
``rollout.group_size`` from the config. The lockstep rollout is priced with and without them twice:
with every prompt at the committed bucket (the bound's layout), and with prompts at their measured
length (the prefill and the lockstep cache at the first ``sampler.length_buckets`` entry holding
head + suffix).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import os

from absl import app, flags

from bipace_jax import step_time
from bipace_jax.buckets import Buckets
from bipace_jax.models import Qwen2Config
from launch import cli
from launch._common import ROOT, write_json

_FLAGS: dict = {}  # defined when run as a script: importing the module (tests) must not claim --out


def _define_flags() -> None:
    _FLAGS["reports"] = flags.DEFINE_string(
        "reports", os.path.join(ROOT, "benchmarks", "aot"), "Folder of AOT reports."
    )
    _FLAGS["heads"] = flags.DEFINE_string(
        "heads", os.path.join(ROOT, "benchmarks", "shared_heads.json"), "launch.head_lengths report (shared heads)."
    )
    _FLAGS["out"] = flags.DEFINE_string("out", os.path.join(ROOT, "benchmarks", "step_time.json"), "JSON report path.")


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


def head_lengths(path: str) -> dict[str, tuple[int, int]]:
    """Per game (shared head, longer row's suffix) in Qwen2.5 tokens, turns 3 and later, from a
    ``launch.head_lengths`` report."""
    with open(path) as f:
        games = json.load(f)["games"]
    return {g: (round(v["head_qwen_later"]), round(v["suffix_qwen_later"])) for g, v in games.items()}


def shared_head_rows(
    m, shape: step_time.RunShape, chip, config, heads: dict[str, tuple[int, int]], game: str | None = None
) -> dict:
    """The lockstep rollout (s per iteration) with and without shared heads: prompts at the committed
    bucket, and at their measured length's bucket (see the module doc); ``game``: another game's
    head lengths on these shapes (default: the config's)."""
    head, suffix = heads[game or config.env.name]
    group = int(config.rollout.group_size)
    bucket = Buckets(tuple(config.sampler.length_buckets), "sampler.length_buckets").fit_or_raise(head + suffix)

    def lock(shape):
        e = step_time.estimate(m, shape, chip)
        return e["rollout_s_lockstep"], e["schedulers"]["rollout"]["shared_heads"]

    full_plain, _ = lock(shape)
    full_shared, full_info = lock(dataclasses.replace(shape, shared_head_tokens=head, group_size=group))
    measured = dataclasses.replace(shape, rollout_prompt_tokens=bucket)
    meas_plain, _ = lock(measured)
    meas_shared, meas_info = lock(
        dataclasses.replace(measured, shared_head_tokens=head, head_suffix_tokens=suffix, group_size=group)
    )
    return dict(
        shared_head_tokens=head,
        head_suffix_tokens=suffix,
        group_size=group,
        measured_prompt_bucket=bucket,
        rollout_s_lockstep_shared_heads=full_shared,
        shared_heads_saving_s=full_plain - full_shared,
        shared_heads_at_bucket=full_info,
        rollout_s_lockstep_measured_prompts=meas_plain,
        rollout_s_lockstep_measured_prompts_shared_heads=meas_shared,
        shared_heads_saving_s_measured_prompts=meas_plain - meas_shared,
        speedup_shared_heads_rollout_measured_prompts=meas_plain / meas_shared,
        shared_heads_at_measured=meas_info,
    )


def rows(reports_dir: str, heads_path: str | None = None) -> list[dict]:
    heads = head_lengths(heads_path) if heads_path else None
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
        config = importlib.import_module(f"configs.{report['config']}").get_config()
        shared = shared_head_rows(m, shape, chip, config, heads) if heads else {}
        if heads and config.env.name == "alfworld":
            # TextCraft's paper configs play ALFWorld's loop (50 turns, 2048 + 512 tokens, same meshes):
            # its prompts on these shapes, as no TextCraft report is committed
            keep = ("measured_prompt_bucket", "rollout_s_lockstep_measured_prompts")
            tc = shared_head_rows(m, shape, chip, config, heads, game="textcraft")
            shared["textcraft_on_these_shapes"] = {
                k: v for k, v in tc.items() if k.startswith(keep) or "shared_head" in k or k == "head_suffix_tokens"
            }
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
                **shared,
            )
        )
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    table = rows(_FLAGS["reports"].value, _FLAGS["heads"].value)
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
    print()
    print(
        "| config | slice | head / suffix tokens, group | lockstep rollout s, prompts at the bucket: plain / shared heads "
        "| measured prompts (bucket): plain / shared heads, saving |"
    )
    print("|---|---|---|---|---|")
    for r in table:
        why = r["shared_heads_at_measured"]["why_not"]
        print(
            f"| {r['config']} | {r['slice']} | {r['shared_head_tokens']} / {r['head_suffix_tokens']}, {r['group_size']} | "
            f"{r['rollout_s_lockstep']:.1f} / {r['rollout_s_lockstep_shared_heads']:.1f} | "
            f"({r['measured_prompt_bucket']}) {r['rollout_s_lockstep_measured_prompts']:.1f} / "
            f"{r['rollout_s_lockstep_measured_prompts_shared_heads']:.1f}, {r['shared_heads_saving_s_measured_prompts']:.1f} s"
            + (f" ({why})" if why else "")
            + " |"
        )
    write_json(
        _FLAGS["out"].value,
        dict(
            method="launch.step_table: step_time.estimate on the committed AOT reports' shapes (no compile); "
            "rollout with lognormal responses (step_time.rollout_model, bipace_jax.schedule_sim)",
            rows=table,
        ),
        indent=1,
    )


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
