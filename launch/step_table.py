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

Beside the floor, the expected time: every program's roofline seconds times the factor a
``launch.bench_step`` report measured (``--calibration``, `step_time.Calibration`, with its device,
date and commit); and the asynchronous schedule (`step_time.best_split`: a sampler group and a
learner group of hosts overlapped, the fastest split whose roles fit in HBM), with each role's
compiled per-chip memory where ``launch.aot --roles`` committed a report (``<config>__<topology>__roles-*``);
where those reports put the roles on slices of their own (``--role_topologies``), the weight push is
priced over the data-center network.
``--docs`` rewrites the generated tables in README.md ("At pod scale") and docs/pod.md (section 7)
between their ``<!-- launch.step_table:NAME -->`` markers.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import os
import re

from absl import app, flags

from bipace_jax import step_time
from bipace_jax.buckets import Buckets
from bipace_jax.models import Qwen2Config
from launch import cli
from launch._common import ROOT, write_json

GiB = 1 << 30

_FLAGS: dict = {}  # defined when run as a script: importing the module (tests) must not claim --out


def _define_flags() -> None:
    _FLAGS["reports"] = flags.DEFINE_string(
        "reports", os.path.join(ROOT, "benchmarks", "aot"), "Folder of AOT reports."
    )
    _FLAGS["heads"] = flags.DEFINE_string(
        "heads", os.path.join(ROOT, "benchmarks", "shared_heads.json"), "launch.head_lengths report (shared heads)."
    )
    _FLAGS["out"] = flags.DEFINE_string("out", os.path.join(ROOT, "benchmarks", "step_time.json"), "JSON report path.")
    _FLAGS["calibration"] = flags.DEFINE_string(
        "calibration", CALIBRATION, "launch.bench_step report whose measured/modelled factors give the expected time."
    )
    _FLAGS["docs"] = flags.DEFINE_bool("docs", False, "Rewrite the generated tables in README.md and docs/pod.md.")


#: The committed calibration (one H200, `launch.bench_step`).
CALIBRATION = os.path.join(ROOT, "benchmarks", "step_nvidia_h200.json")
#: Files whose tables `--docs` rewrites, and the tables of each.
DOCS = {"README.md": ("pod", "asynchronous"), os.path.join("docs", "pod.md"): ("schedulers", "asynchronous")}


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


def largest_peak(report: dict) -> dict:
    """The report's program or transient with the largest per-chip total: its ``name``, ``bytes`` and
    ``fraction`` of HBM."""
    hbm = report["hbm_bytes_per_chip"]
    items = [(k, p["total_bytes_per_chip"]) for k, p in report["programs"].items()]
    items += [(k, t["bytes_per_chip"]) for k, t in report.get("transients", {}).items()]
    name, size = max(items, key=lambda kv: kv[1])
    return dict(name=name, bytes=size, fraction=size / hbm)


def role_report(reports_dir: str, report_file: str, sampler_hosts: int) -> dict | None:
    """Per-chip compiled memory of each role from ``launch.aot --roles``'s report for this run and split
    (``<report>__roles-<S>s<L>l.json``): the largest total per role (``sampler``, ``learner``, ``push``:
    ``program``, ``bytes``, ``fraction`` of HBM), whether every program fits, and ``role_topologies``
    (the roles' own slices, {} when they are parts of the report's); None when none is committed."""
    with open(os.path.join(reports_dir, report_file)) as f:
        hosts = json.load(f)["hosts"]
    stem = os.path.splitext(report_file)[0]
    path = os.path.join(reports_dir, f"{stem}__roles-{sampler_hosts}s{hosts - sampler_hosts}l.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        r = json.load(f)
    out = {}
    for role, progs in r["roles"].items():
        name, p = max(progs.items(), key=lambda kv: kv[1]["total_bytes_per_chip"])
        out[role] = dict(program=name, bytes=p["total_bytes_per_chip"], fraction=p["fraction_of_hbm"])
    return dict(report=os.path.basename(path), fits=r["fits"], role_topologies=r.get("role_topologies", {}), **out)


def roles_apart(reports_dir: str, report_file: str) -> bool:
    """Whether the committed ``launch.aot --roles`` reports of this run put the roles on slices of their
    own (``--role_topologies``: libtpu refuses a program over part of the slice), so the weight push
    crosses the data-center network."""
    stem = os.path.splitext(report_file)[0]
    for path in glob.glob(os.path.join(reports_dir, f"{glob.escape(stem)}__roles-*.json")):
        with open(path) as f:
            if json.load(f).get("role_topologies"):
                return True
    return False


def pod_row(report: dict, report_file: str, reports_dir: str, cal: step_time.Calibration) -> dict:
    """The README pod table's row of one report: meshes, largest peak, the floor and the expected
    (calibrated) stages, iteration and run, and the asynchronous schedule's best split."""
    shape = run_shape(report)
    m = step_time.ModelShape.of(Qwen2Config.preset(report["model"]["preset"]))
    chip = step_time.chip_for(report["device_kind"])
    floor = step_time.estimate(m, shape, chip)
    exp = step_time.expected(m, shape, chip, cal)

    def groups(stages: dict) -> dict:
        return dict(
            rollout=stages["rollout"],
            logprobs=stages["logprobs"],
            gradient=stages["ppo_grad"] + stages["ppo_apply"],
            validation=stages.get("validation", 0.0),
            sync=stages["sync"],
        )

    # the learner programs' activations beside the modelled resident arrays (their per-chip rows stay the same)
    progs = report["programs"]
    temp = dict(logprobs=progs["logprobs"]["temp_bytes"], gradient=progs["ppo_grad"]["temp_bytes"])
    # the push crosses the data-center network between slices, or between the roles' own slices
    apart = roles_apart(reports_dir, report_file)
    dcn = step_time.DCN_BYTES_PER_S_PER_HOST if report.get("num_slices", 1) > 1 or apart else None
    splits = {}
    for name, factors in (("floor", None), ("expected", cal.factors)):
        splits[name] = step_time.best_split(m, shape, chip, factors, dcn, headroom=temp)
    best = splits["expected"]["best"]
    if best is None:  # no split fits: the synchronous run only
        at_floor = None
    else:
        at_floor = next(a for a in splits["floor"]["candidates"] if a["sampler_hosts"] == best["sampler_hosts"])
    mesh, sm = report["mesh"], report["sampler_mesh"]
    return dict(
        training_mesh="x".join(str(mesh[k]) for k in ("data", "fsdp", "tensor")),
        sampler_mesh="x".join(str(sm.get(k, 1)) for k in ("data", "fsdp", "tensor")),
        largest_peak=largest_peak(report),
        stages_s_floor=groups(floor["stages_s"]),
        stages_s_expected=groups(exp["stages_s"]),
        iteration_s_expected=exp["iteration_s"],
        run_hours_bound=floor["run_hours"],
        run_hours_expected=exp["run_hours"],
        chip_hours_bound=floor["chip_hours"],
        chip_hours_expected=exp["run_hours"] * shape.chips,
        async_schedule=dict(
            push_link="DCN" if dcn else "ICI",
            roles_apart=apart,
            best_expected=best,
            best_at_floor=at_floor,
            speedup_async_expected=best and best["speedup_async"],
            speedup_async_floor=at_floor and at_floor["speedup_async"],
            candidates=[
                dict(
                    sampler_hosts=a["sampler_hosts"],
                    learner_hosts=a["learner_hosts"],
                    fits=a["fits"],
                    iteration_s_floor=f["iteration_s"],
                    iteration_s_expected=a["iteration_s"],
                )
                for a, f in zip(splits["expected"]["candidates"], splits["floor"]["candidates"])
            ],
            aot=best and role_report(reports_dir, report_file, best["sampler_hosts"]),
        ),
    )


def rows(reports_dir: str, heads_path: str | None = None, calibration_path: str = CALIBRATION) -> list[dict]:
    heads = head_lengths(heads_path) if heads_path else None
    with open(calibration_path) as f:
        cal = step_time.Calibration.from_report(json.load(f))
    out = []
    for path in sorted(glob.glob(os.path.join(reports_dir, "*.json"))):
        with open(path) as f:
            report = json.load(f)
        if "step_time" not in report or "roles" in report:
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
                **pod_row(report, os.path.basename(path), reports_dir, cal),
            )
        )
    return out


def _name(config: str) -> str:
    game, size = config.split("_qwen2_5_")
    return f"{game} {size.replace('_', '.')}"


def _slice(r: dict) -> str:
    return f"{r['slice']} ({r['chips']} chips, {r['hosts']} hosts)"


def pod_table(table: list[dict], cal: step_time.Calibration) -> str:
    """README's pod table (markdown): meshes, peak memory, the floor and expected stages and run."""
    lines = [
        "| config | slice | training mesh (data x fsdp x tensor) | host sampler mesh | largest per-chip peak (share of HBM) "
        "| rollout / log-probs / gradient / validation s per iteration: floor; expected | iteration s: floor / expected "
        "| 150 iterations: floor / expected |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        peak = r["largest_peak"]
        f, e = r["stages_s_floor"], r["stages_s_expected"]
        keys = ("rollout", "logprobs", "gradient", "validation")
        lines.append(
            f"| {_name(r['config'])} | {_slice(r)} | {r['training_mesh']} | {r['sampler_mesh']} | "
            f"{peak['name']}, {peak['bytes'] / GiB:.1f} GiB ({peak['fraction']:.0%}) | "
            + " / ".join(f"{f[k]:.0f}" for k in keys)
            + "; "
            + " / ".join(f"{e[k]:.0f}" for k in keys)
            + f" | {r['iteration_s_bound']:.0f} / {r['iteration_s_expected']:.0f} | "
            f"{r['run_hours_bound']:.1f} / {r['run_hours_expected']:.1f} h, "
            f"{r['chip_hours_bound']:.0f} / {r['chip_hours_expected']:.0f} chip-h |"
        )
    names = dict(logprobs="log-probs", ppo_grad="gradient", ppo_apply="AdamW", prefill="prefill", decode_step="decode")
    factors = ", ".join(f"{names.get(k, k)} {v:.2f}x" for k, v in cal.factors.items())
    lines += [
        "",
        f"Expected = each program's floor x its measured / modelled factor from `launch.bench_step` on one "
        f"{cal.device} ({cal.date[:10]}, commit {cal.commit}; `benchmarks/step_nvidia_h200.json`, "
        f"`step_time.Calibration`): {factors}. No TPU has calibrated the model: on a TPU the expected "
        "column holds only as far as XLA reaches the same share of the chip's peaks there.",
    ]
    return "\n".join(lines)


def _compiled(aot: dict | None, role: str) -> str:
    """One role's compiled per-chip peak cell: ``program X GiB (share)``, flagged when over the budget."""
    if not aot:
        return "not compiled"
    r = aot[role]
    over = "" if aot["fits"][role] else ", over the 90% budget"
    return f"{r['program']} {r['bytes'] / GiB:.1f} GiB ({r['fraction']:.0%}{over})"


def async_table(table: list[dict]) -> str:
    """The asynchronous schedule's table (markdown): the best split by expected time (and the slices
    its roles were compiled on), synchronous vs asynchronous iteration at the floor and expected, the
    modelled memory, and each role's compiled per-chip peak (``launch.aot --roles``)."""
    lines = [
        "| config | slice | split: sampler + learner hosts | sampler / learner / weight push s per iteration, expected "
        "| iteration s, synchronous / asynchronous: floor | expected | modelled per-chip memory, sampler / learner "
        "| sampler, compiled per chip (share of HBM) | learner, compiled | weight push, compiled (a learner chip) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        a = r["async_schedule"]
        b, f = a["best_expected"], a["best_at_floor"]
        if b is None:
            lines.append(f"| {_name(r['config'])} | {r['slice']} | no split fits | | | | | | | |")
            continue
        mem = b["memory_bytes_per_chip"]
        learner = max(mem["logprobs"], mem["gradient"])
        aot = a["aot"]
        split = f"{b['sampler_hosts']} + {b['learner_hosts']}"
        if aot and aot["role_topologies"]:
            t = aot["role_topologies"]
            split += f" (slices of their own: {t['sampler']} + {t['learner']})"
        slower = " (synchronous is faster)" if b["speedup_async"] < 1 else ""
        lines.append(
            f"| {_name(r['config'])} | {r['slice']} | {split} | "
            f"{b['sampler_s']:.0f} / {b['learner_s']:.0f} / {b['push_s']:.2f} ({a['push_link']}) | "
            f"{f['synchronous_s']:.0f} / {f['iteration_s']:.0f} ({f['speedup_async']:.2f}x) | "
            f"{b['synchronous_s']:.0f} / {b['iteration_s']:.0f} ({b['speedup_async']:.2f}x){slower} | "
            f"{mem['sampler'] / GiB:.1f} / {learner / GiB:.1f} GiB | "
            + " | ".join(_compiled(aot, k) for k in ("sampler", "learner", "push"))
            + " |"
        )
    return "\n".join(lines)


def schedulers_table(table: list[dict]) -> str:
    """docs/pod.md section 7's table (markdown): the rollout under both schedulers and shared heads."""
    lines = [
        "| config | slice | games (= slots) per host | rollout s per iteration: bound / lockstep / continuous "
        "| decode steps per host, lockstep / continuous | s per iteration: bound / lockstep / continuous "
        "| 150 iterations, h: lockstep / continuous | lockstep rollout s, measured prompts: plain / shared heads (saving) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        plain, shared = r["rollout_s_lockstep_measured_prompts"], r["rollout_s_lockstep_measured_prompts_shared_heads"]
        info = r["shared_heads_at_measured"]
        split = re.match(r"off \(the host's sampler splits rows (\d+) ways\)", info["why_not"])
        if info["applies"]:
            heads = f"{plain:.1f} / {shared:.1f} ({plain - shared:.1f} s)"
        elif split:
            heads = f"{plain:.1f} / off (rows split {split.group(1)} ways)"
        else:
            heads = f"{plain:.1f} / {shared:.1f} ({info['why_not'].split(' (')[0]})"
        lines.append(
            f"| {_name(r['config'])} | {r['slice']} | {r['games_per_host']} | {r['rollout_s_bound']:.0f} / "
            f"{r['rollout_s_lockstep']:.0f} / {r['rollout_s_continuous']:.0f} ({r['speedup_continuous_rollout']:.2f}x) | "
            f"{r['decode_steps_lockstep']:.0f} / {r['decode_steps_continuous']:.0f} ({r['speedup_decode_steps']:.2f}x) | "
            f"{r['iteration_s_bound']:.0f} / {r['iteration_s_lockstep']:.0f} / {r['iteration_s_continuous']:.0f} | "
            f"{r['run_hours_lockstep']:.1f} / {r['run_hours_continuous']:.1f} | {heads} |"
        )
    return "\n".join(lines)


def tables(table: list[dict], cal: step_time.Calibration) -> dict[str, str]:
    """Every generated table by its marker name."""
    return dict(pod=pod_table(table, cal), asynchronous=async_table(table), schedulers=schedulers_table(table))


def replace_marked(text: str, name: str, body: str) -> str:
    """``text`` with what lies between ``<!-- launch.step_table:NAME -->`` and ``<!-- /launch.step_table:NAME -->``
    replaced by ``body``.

    Raises:
      ValueError: the markers are missing.
    """
    start, end = f"<!-- launch.step_table:{name} -->", f"<!-- /launch.step_table:{name} -->"
    if start not in text or end not in text:
        raise ValueError(f"no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    table = rows(_FLAGS["reports"].value, _FLAGS["heads"].value, _FLAGS["calibration"].value)
    with open(_FLAGS["calibration"].value) as f:
        cal = step_time.Calibration.from_report(json.load(f))
    generated = tables(table, cal)
    for body in generated.values():
        print(body, end="\n\n")
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
            calibration=dict(
                report=os.path.relpath(_FLAGS["calibration"].value, ROOT),
                device=cal.device,
                date=cal.date,
                commit=cal.commit,
                factors=cal.factors,
            ),
            rows=table,
        ),
        indent=1,
    )
    if _FLAGS["docs"].value:
        for doc, names in DOCS.items():
            path = os.path.join(ROOT, doc)
            with open(path) as f:
                text = f.read()
            for name in names:
                text = replace_marked(text, name, generated[name])
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote the {', '.join(names)} tables into {doc}")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
