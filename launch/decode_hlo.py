"""Kernels per decode step: the compiled ``decode`` program's loop body, counted from its HLO.

    python -m launch.decode_hlo                  # CPU: writes benchmarks/decode_hlo.json

What transfers from a CPU to an accelerator is the program's structure, not its CPU time: on a GPU
every top-level instruction of the decode loop's body is (at least) one kernel launch, and every
iteration of a ``while`` loop inside the body one more launch and a host round trip for its
condition. This compiles the sampler's ``decode`` program (lockstep: ``decode``; the continuous
scheduler's slots: ``decode_chunk``) for the CPU benchmark model (``launch.bench_step``'s ``cpu``
preset: V 1024, D 128, 3 layers, 4 heads over 2 KV heads) at B = 16, for greedy, temperature
sampling, top-k + top-p and two stop strings, and counts per decode step:

* ``kernels``: non-trivial instructions run by one iteration of the decode loop, inner loops
  expanded by their trip counts (parameters, tuples, constants and bitcasts are free);
* ``loop_iterations``: iterations of loops inside one step (host round trips on a GPU). The threefry
  hash of ``jax.random`` is a 5-iteration loop in XLA's CPU lowering only (unrolled on GPU/TPU):
  counted in both columns here, as compiled;
* ``sorts``; ``state_aliased``: the donated ``DecodeState``'s arrays written in place (aliased to
  an input by the compiled program) out of all of them.

Two schedules of the same code: ``cpu`` (what XLA's CPU backend gets: per-row KV writes as a loop
of slice writes, top-k/top-p bisection loops) and ``accelerator`` (per-row KV writes by one scatter,
top-k by ``lax.top_k``, the nucleus bisection unrolled), the latter traced here by answering "gpu" to
the two device queries that pick them (``models.qwen2`` and ``sampling.filters``). Before this
round the accelerators ran the ``cpu`` schedule's structure.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
from unittest import mock

import jax
from flax import nnx

from launch._common import write_json

FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}
SETTINGS = {
    "greedy": dict(greedy=True),
    "sampled": dict(greedy=False, temperature=0.7),
    "top_k_top_p": dict(greedy=False, temperature=0.7, top_k=20, top_p=0.9),
    "stop_strings": dict(greedy=False, temperature=0.7, stop_strings=("</a>", "\n\n")),
}


def computations(text: str) -> dict[str, list[str]]:
    """HLO text -> {computation name: its instruction lines}."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur is not None and "=" in line:
            comps[cur].append(line.strip())
    return comps


def opcode(line: str) -> str:
    """The opcode of one HLO instruction line (``%x = f32[2]{0} add(%a, %b), ...`` -> ``add``)."""
    rhs = line.split("=", 1)[1].strip()
    if rhs.startswith("("):  # a tuple-shaped result: skip its type
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rhs = rhs[i + 1 :].strip()
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else rhs
    m = re.match(r"([\w\-]+)\(", rhs)
    return m.group(1) if m else "?"


def executed(comps: dict, name: str) -> tuple[int, int]:
    """(kernels, loop iterations) of one run of computation ``name``: whiles expanded by their known
    trip counts (1 when unknown), calls inlined."""
    kernels = iters = 0
    for line in comps[name]:
        op = opcode(line)
        if op in FREE:
            continue
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            n = int(trips.group(1)) if trips else 1
            body_k, body_i = executed(comps, re.search(r"body=%([\w.\-]+)", line).group(1))
            cond_k, _ = executed(comps, re.search(r"condition=%([\w.\-]+)", line).group(1))
            kernels += n * (body_k + cond_k)
            iters += n * (body_i + 1)
        elif op == "call":
            k, i = executed(comps, re.search(r"to_apply=%([\w.\-]+)", line).group(1))
            kernels, iters = kernels + k, iters + i
        else:
            kernels += 1
    return kernels, iters


def count(compiled) -> dict:
    """The per-step counts of a compiled ``decode`` program (see the module docstring)."""
    text = compiled.as_text()
    comps = computations(text)
    loop = next(x for x in text.splitlines() if " while(" in x and 'op_name="jit(decode)/while"' in x)
    kernels, iters = executed(comps, re.search(r"body=%([\w.\-]+)", loop).group(1))
    header = text[: text.index("\n")]
    aliased = len(re.findall(r"\{\d*\}: \(\d+, \{\d*\}, (?:may|must)-alias\)", header))
    outputs = len(jax.tree.leaves(compiled.out_info))
    ops = collections.Counter(opcode(x) for x in comps[re.search(r"body=%([\w.\-]+)", loop).group(1)])
    return dict(
        kernels=kernels,
        loop_iterations=iters,
        top_level=sum(n for k, n in ops.items() if k not in FREE),
        sorts=text.count(" sort("),
        state_aliased=f"{aliased}/{outputs - 1}",  # every output but the step count is the state
    )


def measure(batch: int, chunk: int) -> dict:
    """{setting: {program: {schedule: counts}}} for the CPU benchmark model at ``batch`` rows."""
    from bipace_jax.models import Qwen2Actor, Qwen2Config
    from bipace_jax.programs import abstract
    from bipace_jax.sampling import SamplerConfig
    from bipace_jax.sampling.engine import abstract_programs
    from launch.bench_step import PRESETS

    cfg = dataclasses.replace(Qwen2Config.tiny(), **dict(PRESETS["cpu"].tiny))
    graphdef, params = nnx.split(Qwen2Actor(cfg))
    params = abstract(params)
    out = {}
    for name, kw in SETTINGS.items():
        kw = dict(kw)
        stops = kw.pop("stop_strings", ())
        scfg = SamplerConfig(max_new_tokens=32, eos_token_ids=(cfg.vocab_size - 1,), stop_strings=stops, **kw)
        row = out[name] = {}
        for program, extra in (("decode", dict(batch=batch)), ("decode_chunk", dict(slots=batch, chunk=chunk))):
            row[program] = {}
            for schedule in ("cpu", "accelerator"):
                platform = "cpu" if schedule == "cpu" else "gpu"
                jax.clear_caches()  # the jitted programs would reuse the other schedule's trace
                with (
                    mock.patch("bipace_jax.models.qwen2.device_platform", lambda p=platform: p),
                    mock.patch("bipace_jax.sampling.filters.device_platform", lambda p=platform: p),
                ):
                    specs = abstract_programs(scfg, graphdef, params, vocab=cfg.vocab_size, prompt_len=128, **extra)
                    row[program][schedule] = count(specs[program].lower().compile())
    return out


def table(result: dict) -> str:
    lines = [
        f"{'setting':13s} {'program':12s} {'schedule':11s} {'kernels':>7s} {'loops':>5s} {'top':>4s} sorts aliased"
    ]
    for name, progs in result.items():
        for program, scheds in progs.items():
            for schedule, c in scheds.items():
                lines.append(
                    f"{name:13s} {program:12s} {schedule:11s} {c['kernels']:7d} {c['loop_iterations']:5d} "
                    f"{c['top_level']:4d} {c['sorts']:5d} {c['state_aliased']}"
                )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="decode rows (lockstep batch and slots)")
    parser.add_argument("--chunk", type=int, default=8, help="decode steps of one continuous chunk")
    parser.add_argument("--out", default="benchmarks/decode_hlo.json")
    args = parser.parse_args(argv)
    result = measure(args.batch, args.chunk)
    print(table(result))
    slots = result["greedy"]["decode_chunk"]
    summary = dict(
        slot_kernels_per_step_cpu_schedule=slots["cpu"]["kernels"],
        slot_kernels_per_step_accelerator_schedule=slots["accelerator"]["kernels"],
        slot_kernel_reduction=slots["cpu"]["kernels"] / slots["accelerator"]["kernels"],
    )
    write_json(
        args.out, dict(backend=jax.default_backend(), batch=args.batch, summary=summary, settings=result), indent=1
    )


if __name__ == "__main__":
    main()
