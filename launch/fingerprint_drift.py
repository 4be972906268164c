"""How far the real actor's fingerprints move per policy update, and what mixing versions does to step groups.

    python -m launch.train --workdir=runs/drift_tiny --config.num_iterations=6 --config.checkpoint.keep=10
    python -m launch.fingerprint_drift --run=runs/drift_tiny --out=docs/results/fingerprint_drift_textcraft_tiny

The measurement behind the lab's staleness arm (``docs/lab.md``, "Staleness"): the lab models the
drift of the actor's hidden-state map as a random walk, ``d`` per version; this command measures it
on a real run. It rebuilds the run's actor, learner, sampler and game pool from ``--config`` (the
run's config file and overrides, checked against the run's ``config.json``), replays the rollout of
iteration ``--batch_version`` with the parameters of that version (the run's own task groups and
sampler key, so the batch is the one the run played; ``transcript_match`` says how many of the run's
transcript prompts it reproduces), and fingerprints every step row of that one fixed batch under each
saved version v (version 0 = the config's initial model, v >= 1 = ``checkpoints/<v>``). The fingerprint
is the sampler's: ``Qwen2Actor.prefill``'s L2-normalised hidden state ``model.fingerprint_layer`` at
the last prompt token (``fingerprint_gap_max`` compares version ``--batch_version``'s recomputed values
with the sampler's own, which prefills shared heads then extends, so they agree up to float order).

Per version lag d (every pair v, v + d of saved versions):

* ``one_minus_cos``: mean / median / p90 of 1 - cos(f_v, f_{v+d}) over the batch's distinct prompts;
* ``lab_drift``: the lab's drift per version with the same mean cosine, d_lab = sqrt((1/c^2 - 1) / d)
  with c = 1 - mean(1 - cos) (the lab's e_l = normalise(e + d_lab W_l / sqrt(D)) has cos(e_0, e_l)
  = 1 / sqrt(1 + l d_lab^2)); ``lab_drift_at_lab_epsilon``: the same with 1 - cos first scaled by
  the lab's epsilon over the run's (the drift that moves a lab fingerprint as many epsilons as the
  real one moves; NaN when that is more than a whole cosine);
* per estimator (``--estimators``, at the run's epsilon, ``estimators.step_details``' step groups):
  ``mixed_changed``, the fraction of rows whose step group (its set of co-members) differs between
  the batch fingerprinted all at v + d (synchronous) and the batch whose games are each at v or
  v + d with probability 1/2 (a sampler d versions behind for half the games; mean over ``--splits``
  draws); ``pure_changed`` (all at v against all at v + d: how much the partition itself moves);
  the mean step-group size and singleton group rate of the synchronous and mixed batches;
* with ``--lab_seeds`` > 0, the lab's side of the same measure (``lab_changed``: the staleness grid's
  scored cells, ``--lab_seeds`` seeds): ``lab_mixed_changed`` at each of the lab's ``grid.drifts``, and
  ``lab_drift_same_change``, the lab drift per version whose mixed_changed at lag d equals the measured
  one (null above the lab's plateau, where every cross-version cluster has split).

Writes ``--out``/drift.json, drift.png and prints a table. Bad flags fail with one line before the
model loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import flags, logging

from launch import cli
from launch._common import ROOT

# The flag holders, defined only when run as a command (``_define_flags``): tests import this module
# beside other launch modules that define ``--config`` and ``--out``.
_CONFIG = _RUN = _VERSIONS = _BATCH_VERSION = _ESTIMATORS = _EPSILON = _SPLITS = _SEED = _CHUNK = _OUT = _LAB_SEEDS = (
    None
)


def _define_flags():
    global _CONFIG, _RUN, _VERSIONS, _BATCH_VERSION, _ESTIMATORS, _EPSILON, _SPLITS, _SEED, _CHUNK, _OUT, _LAB_SEEDS
    _CONFIG = cli.define_config_file(
        "config", os.path.join(ROOT, "configs", "textcraft_tiny.py"), "The run's config file (with its overrides)."
    )
    _RUN = flags.DEFINE_string("run", "", "Run folder whose checkpoints/<v> are the versions (checkpoint.every 1).")
    _VERSIONS = flags.DEFINE_string(
        "versions", "", "Comma-separated versions to fingerprint ('' = 0 and every checkpoint of the run)."
    )
    _BATCH_VERSION = flags.DEFINE_integer("batch_version", 0, "The version whose rollout (iteration) is the batch.")
    _ESTIMATORS = flags.DEFINE_string(
        "estimators", "bigpo,bipace_q", "Clustering estimators whose step groups to compare."
    )
    _EPSILON = flags.DEFINE_float("epsilon", 0.0, "Cluster epsilon (0 = the run's, from its first checkpoint).")
    _SPLITS = flags.DEFINE_integer("splits", 8, "Random half-and-half version mixes per pair of versions.")
    _SEED = flags.DEFINE_integer("seed", 0, "Seed of the version mixes.")
    _CHUNK = flags.DEFINE_integer("chunk", 64, "Prompts per fingerprint forward.")
    _OUT = flags.DEFINE_string("out", "", "Output folder ('' = <run>/fingerprint_drift).")
    _LAB_SEEDS = flags.DEFINE_integer("lab_seeds", 10, "Lab seeds per comparison batch (0 = no lab comparison).")


#: Config sections whose values shape the batch or its fingerprints: they must equal the run's.
CHECKED_SECTIONS = ("model", "env", "tasks", "rollout", "sampler", "seed")


# ---------------------------------------------------------------------------------------------------
# The measurement (pure NumPy / the estimators; what tests/test_fingerprint_drift.py checks).


def one_minus_cos(f_a: np.ndarray, f_b: np.ndarray) -> np.ndarray:
    """float64[N] 1 - cos of the rows of two float[N, D] fingerprint arrays (renormalised in float64)."""
    a, b = (np.asarray(f, np.float64) for f in (f_a, f_b))
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"one_minus_cos: expected two [N, D] arrays of one shape, got {a.shape} and {b.shape}")
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return 1.0 - np.sum(a * b, axis=1)


def lab_drift(mean_one_minus_cos: float, lag: int) -> float:
    """The lab's drift per version (``LabView.drift``) whose expected cosine after ``lag`` versions is
    c = 1 - ``mean_one_minus_cos``: cos = 1 / sqrt(1 + lag d^2), so d = sqrt((1/c^2 - 1) / lag).
    NaN when c <= 0 (no drift of the model reaches it)."""
    c = 1.0 - float(mean_one_minus_cos)
    if c <= 0:
        return float("nan")
    return math.sqrt(max(1.0 / (c * c) - 1.0, 0.0) / lag)


def lab_one_minus_cos(drift: float, lag: int) -> float:
    """1 - cos(e_0, e_lag) of the lab's drift model at ``drift`` per version: 1 - 1 / sqrt(1 + lag drift^2)."""
    return 1.0 - 1.0 / math.sqrt(1.0 + lag * drift * drift)


def changed_rows(labels_a: np.ndarray, labels_b: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """bool[N]: rows whose step group (the set of rows sharing its label) differs between two labelings.

    Labels < 0 (padding, invalid rows: the same rows in both, they do not depend on fingerprints) are
    never changed and never co-members. Labels are arbitrary ids: only equality within a labeling counts.
    ``groups`` int[N] (task groups, which no step group crosses): compare group by group, in memory of
    the largest group squared instead of N squared.
    """
    a, b = np.asarray(labels_a), np.asarray(labels_b)
    if groups is not None:
        out = np.zeros(a.shape, bool)
        for g in np.unique(groups):
            rows = np.flatnonzero(np.asarray(groups) == g)
            out[rows] = changed_rows(a[rows], b[rows])
        return out
    ok = (a >= 0) & (b >= 0)
    same_a = (a[:, None] == a[None, :]) & ok[:, None] & ok[None, :]
    same_b = (b[:, None] == b[None, :]) & ok[:, None] & ok[None, :]
    return ok & np.any(same_a != same_b, axis=1)


def mixed_fingerprints(old: np.ndarray, new: np.ndarray, traj: np.ndarray, rng: np.random.Generator):
    """(float32[N, D], bool[N] rows at ``old``): each game (``traj`` id) takes ``old`` or ``new`` with
    probability 1/2, all its rows alike (a sampler behind by the lag for that game)."""
    games = np.unique(traj)
    stale = dict(zip(games.tolist(), (rng.random(games.size) < 0.5).tolist()))
    at_old = np.array([stale[t] for t in traj.tolist()], bool)
    return np.where(at_old[:, None], old, new).astype(np.float32), at_old


def _with_rows(steps, num_rows: int, fp: np.ndarray):
    """``steps`` with its first ``num_rows`` fingerprints replaced by ``fp`` (padding rows kept)."""
    full = np.array(steps.fingerprint, np.float32)
    full[:num_rows] = fp
    return steps.replace(fingerprint=full)


def _partition(steps, num_rows, fp, cfg):
    """(labels int32[num_rows], size statistics) of ``cfg``'s step groups with fingerprints ``fp``."""
    from bipace_jax.estimators import compute_advantages, step_details

    batch = _with_rows(steps, num_rows, fp)
    labels, _ = step_details(batch, cfg)
    diag = compute_advantages(batch, cfg)[1]
    sizes = {k: float(diag[k]) for k in ("mean_group_size", "singleton_group_rate", "num_step_groups")}
    return np.asarray(labels)[:num_rows], sizes


def drift_report(fingerprints: dict, steps, num_rows: int, prompt_ids: np.ndarray, configs: dict, *, splits, seed):
    """Drift statistics of one fixed batch fingerprinted under several versions.

    Args:
      fingerprints: {version int: float32[N, D]} the batch's N = ``num_rows`` real rows under each version.
      steps: the batch's ``StepBatch`` (first ``num_rows`` rows real; its fingerprints are replaced).
      prompt_ids: int[N] id of each row's prompt (equal prompts, equal id): drift is over distinct prompts.
      configs: {name: EstimatorConfig} the clustering estimators to compare (at the run's epsilon).
      splits: version mixes drawn per pair; seed: their generator's seed.
    Returns:
      {"pairs": [per (v, v + d) record], "lags": {d: summary over the pairs of lag d}} (``module doc``).
    Raises:
      ValueError: fewer than two versions, or a fingerprint array that is not [num_rows, D].
    """
    versions = sorted(fingerprints)
    if len(versions) < 2:
        raise ValueError(f"drift_report: need at least two versions, got {versions}")
    for v in versions:
        if np.ndim(fingerprints[v]) != 2 or np.shape(fingerprints[v])[0] != num_rows:
            raise ValueError(
                f"drift_report: version {v}'s fingerprints must be [{num_rows}, D], got {np.shape(fingerprints[v])}"
            )
    _, first = np.unique(np.asarray(prompt_ids), return_index=True)
    traj = np.asarray(steps.traj_id)[:num_rows]
    group = np.asarray(steps.group_id)[:num_rows]
    rng = np.random.default_rng(seed)
    parts = {(v, n): _partition(steps, num_rows, fingerprints[v], c) for v in versions for n, c in configs.items()}
    pairs = []
    for i, v in enumerate(versions):
        for w in versions[i + 1 :]:
            x = one_minus_cos(fingerprints[v][first], fingerprints[w][first])
            rec = {"old": v, "new": w, "lag": w - v, **_stats(x)}
            for name, cfg in configs.items():
                sync, sync_sizes = parts[(w, name)]
                mixed, sizes = [], []
                for _ in range(splits):
                    fp, _ = mixed_fingerprints(fingerprints[v], fingerprints[w], traj, rng)
                    labels, s = _partition(steps, num_rows, fp, cfg)
                    mixed.append(changed_rows(sync, labels, group).mean())
                    sizes.append(s)
                rec[name] = {
                    "mixed_changed": float(np.mean(mixed)),
                    "pure_changed": float(changed_rows(sync, parts[(v, name)][0], group).mean()),
                    "sync_mean_group_size": sync_sizes["mean_group_size"],
                    "mixed_mean_group_size": float(np.mean([s["mean_group_size"] for s in sizes])),
                    "sync_singleton_group_rate": sync_sizes["singleton_group_rate"],
                    "mixed_singleton_group_rate": float(np.mean([s["singleton_group_rate"] for s in sizes])),
                }
            pairs.append(rec)
    lags = {}
    for d in sorted({p["lag"] for p in pairs}):
        these = [p for p in pairs if p["lag"] == d]
        summary = {"pairs": len(these)}
        for k in ("mean", "median", "p90"):
            summary[k] = float(np.mean([p[k] for p in these]))
        for name in configs:
            for k in these[0][name]:
                summary[f"{name}/{k}"] = float(np.mean([p[name][k] for p in these]))
        lags[d] = summary
    return {"pairs": pairs, "lags": lags, "distinct_prompts": int(first.size), "rows": int(num_rows)}


def _stats(x: np.ndarray) -> dict:
    return {"mean": float(np.mean(x)), "median": float(np.median(x)), "p90": float(np.percentile(x, 90))}


def add_lab_units(report: dict, epsilon: float, lab_epsilon: float) -> None:
    """Adds ``lab_drift`` and ``lab_drift_at_lab_epsilon`` to every lag of ``report`` (module doc)."""
    for d, s in report["lags"].items():
        s["lab_drift"] = lab_drift(s["mean"], d)
        s["lab_drift_at_lab_epsilon"] = lab_drift(s["mean"] * lab_epsilon / epsilon, d)
        s["mean_over_epsilon"] = s["mean"] / epsilon


def lab_changed(drift: float, lag: int, names: list[str], seeds: int, seed: int = 0) -> dict:
    """The lab's ``mixed_changed`` at ``drift`` per version and version lag ``lag`` (the staleness grid's
    scored cells: ``grid.stale_paraphrases`` forms, sigma ``grid.paraphrases_at_sigma``, the lab's
    epsilon, ``seeds`` seeds of its batch): the fraction of rows whose step group differs between the
    batch with every game ``lag`` versions old and the batch with each game at lag 0 or ``lag`` with
    probability 1/2. Both fingerprint draws share one generator state, so they differ only in the rows
    that moved. Returns {estimator name: fraction}."""
    import bipace_jax.lab as lab
    from bipace_jax.estimators import step_details
    from bipace_jax.lab import config as lab_config

    c = lab_config.default_config()
    game = lab_config.game(c)
    m, sigma = int(c.grid.stale_paraphrases), float(c.grid.paraphrases_at_sigma)
    view = lab_config.view(c, paraphrases=m, sigma=sigma, drift=float(drift))
    rng = np.random.default_rng([seed, lag])  # one batch and one walk per lag: drifts differ only in scale
    pi = lab.bonus_policy(game, c.score_bonus, seeds)
    shape = (seeds, c.batch.groups, c.batch.group_size)
    ro = lab.sample_rollouts(
        game,
        np.broadcast_to(pi, (lag + 1,) + pi.shape),  # every version plays pi: drift only, as the scored cells
        rng,
        groups=c.batch.groups,
        group_size=c.batch.group_size,
        horizon=c.game.horizon,
        paraphrases=m,
        history=view.history,
        lag=np.full(shape, lag),
    )
    stale = rng.random(shape) < 0.5
    games = ro.traj  # global game index: seed * groups * G + b * G + g
    mixed_lag = np.where(stale.reshape(-1)[games], lag, 0)
    state = int(rng.integers(2**31))
    cfgs = lab_config.estimator_configs(c)
    out = {}
    batches = {}
    for key, lags in (("sync", ro.lag), ("mixed", mixed_lag)):
        ro_k = dataclasses.replace(ro, lag=np.asarray(lags, np.int64))
        b = lab.build_batch(
            game, ro_k, pi, view, np.random.default_rng(state), gamma=c.estimator.gamma, render_text=False
        )
        batches[key] = b.steps
    n = ro.num_rows
    group = np.asarray(ro.group)
    for name in names:
        cfg = cfgs[name] if name in cfgs else dataclasses.replace(next(iter(cfgs.values())), name=name)
        sync, mixed = (np.asarray(step_details(batches[k], cfg)[0])[:n] for k in ("sync", "mixed"))
        out[name] = float(changed_rows(sync, mixed, group).mean())
    return out


def lab_matching_drift(target: float, lag: int, name: str, seeds: int, hi: float = 2.0, steps: int = 14) -> float:
    """The lab drift per version whose ``lab_changed`` at ``lag`` equals ``target`` for estimator ``name``
    (bisection on [0, ``hi``]: one batch and one walk per lag, so the change grows with the drift until
    it levels off where every cross-version cluster has split); NaN when even ``hi`` changes fewer rows
    (the target lies above the lab's plateau: no drift of the model matches it)."""
    lo = 0.0
    if lab_changed(hi, lag, [name], seeds)[name] < target:
        return float("nan")
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if lab_changed(mid, lag, [name], seeds)[name] < target else (lo, mid)
    return 0.5 * (lo + hi)


def add_lab_comparison(report: dict, names: list[str], drifts: list[float], seeds: int) -> None:
    """Adds to every lag d of ``report``: ``lab_mixed_changed`` ({drift: {estimator: lab_changed}} at the
    lab's ``drifts``) and ``lab_drift_same_change`` ({estimator: the lab drift whose mixed_changed at
    lag d equals the measured one}, ``lab_matching_drift``)."""
    for d, s in report["lags"].items():
        s["lab_mixed_changed"] = {f"{x:g}": lab_changed(x, d, names, seeds) for x in drifts}
        s["lab_drift_same_change"] = {n: lab_matching_drift(s[f"{n}/mixed_changed"], d, n, seeds) for n in names}


# ---------------------------------------------------------------------------------------------------
# The run: versions, the batch, the fingerprints.


def _prefill_fingerprint(graphdef, state, ids, mask):
    """The sampler's fingerprint of left-padded prompts: ``Qwen2Actor.prefill``'s ``ActorOutput.fingerprint``."""
    from flax import nnx

    actor = nnx.merge(graphdef, state)
    out, _ = actor.prefill(ids, mask, actor.init_cache(ids.shape[0], ids.shape[1]))
    return out.fingerprint


_JITTED = {}  # the jitted prefill, made once: every version's parameters reuse its compiled program


def prompt_fingerprints(actor, input_ids: np.ndarray, attention_mask: np.ndarray, chunk: int) -> np.ndarray:
    """float32[N, D]: the sampler's fingerprint (``Qwen2Actor.prefill``) of each row of int[N, P]
    left-padded prompts with their int[N, P] attention mask, ``chunk`` rows per forward (one compiled
    shape: the last chunk is padded by repeating its first row)."""
    import jax
    from flax import nnx

    if "prefill" not in _JITTED:
        _JITTED["prefill"] = jax.jit(_prefill_fingerprint, static_argnums=0)
    run = _JITTED["prefill"]
    graphdef, state = nnx.split(actor)
    n, out = input_ids.shape[0], []
    for s in range(0, n, chunk):
        ids, mask = input_ids[s : s + chunk], attention_mask[s : s + chunk]
        pad = chunk - ids.shape[0]
        if pad:
            ids = np.concatenate([ids, np.repeat(ids[:1], pad, 0)])
            mask = np.concatenate([mask, np.repeat(mask[:1], pad, 0)])
        out.append(np.asarray(run(graphdef, state, ids.astype(np.int32), mask.astype(np.int32)))[: chunk - pad])
    return np.concatenate(out).astype(np.float32)


def check_run_config(spec_config, run: str) -> None:
    """Raise ConfigError when ``run``'s config.json differs from ``spec_config`` in ``CHECKED_SECTIONS``."""
    from bipace_jax.config import ConfigError

    with open(os.path.join(run, "config.json")) as f:
        theirs = json.load(f)
    ours = json.loads(spec_config.to_json_best_effort())
    for section in CHECKED_SECTIONS:
        a, b = ours.get(section), theirs.get(section)
        if a != b:
            keys = sorted(set(a) | set(b)) if isinstance(a, dict) and isinstance(b, dict) else [None]
            field = next((k for k in keys if a.get(k) != b.get(k)), None) if keys != [None] else None
            name = f"config.{section}" + (f".{field}" if field else "")
            got = b.get(field) if field else b
            want = a.get(field) if field else a
            raise ConfigError(f"{name}: the run {run} has {got!r}, --config gives {want!r} (pass the run's config)")


def one_process(config):
    """A copy of ``config`` with ``async_rl`` at its colocated values (no roles, k = 0): the replay plays
    one batch on this one process whatever roles the run had, so a by-process or by-device run's own
    ``--config`` overrides apply as they are (the roles and k do not shape a version's fingerprints)."""
    config = config.copy_and_resolve_references()
    if "async_rl" in config:
        config.async_rl.sampler_processes = config.async_rl.sampler_devices = config.async_rl.max_staleness = 0
    return config


def _iteration_key(seed: int, iteration: int):
    """The trainer's rollout key of ``iteration`` (``Trainer.train_iteration``: one split per iteration)."""
    import jax

    from bipace_jax import async_rl

    rng = jax.random.PRNGKey(seed)
    for _ in range(iteration + 1):
        rng, key = jax.random.split(rng)
    return async_rl.iteration_keys(key)[0]


def _transcript_match(run: str, iteration: int, res) -> dict | None:
    """How many of the run's transcript rows of ``iteration``'s rollout the replayed batch holds (by prompt hash)."""
    from bipace_jax import transcripts

    if iteration not in transcripts.iterations(run):
        return None
    rows = [r for r in transcripts.read(run, iteration) if r.get("phase") == transcripts.ROLLOUT]
    ours = set()
    for r in range(len(res.rows)):
        ids = res.prompt_ids[r][res.prompt_mask[r] == 1].astype(np.int32)
        ours.add(hashlib.sha256(ids.tobytes()).hexdigest()[:16])
    return {"rows": len(rows), "matched": sum(r["prompt_hash"] in ours for r in rows)}


def measure(config, run: str, versions: list[int], batch_version: int, names: list[str], epsilon: float, **kw):
    """Replay the batch, fingerprint it under every version, and return the report (module doc).

    ``config``: the run's config (a ConfigDict, as ``--config`` gives it); ``kw``: ``splits``, ``seed``,
    ``chunk``, ``lab_seeds`` (the flags). Raises ConfigError for a bad config field or one that differs
    from the run's ``config.json`` in ``CHECKED_SECTIONS`` (before the model loads)."""
    import jax

    from bipace_jax import build, tasks
    from bipace_jax.checkpointing import Checkpointer
    from bipace_jax.rollout import collect
    from bipace_jax.trainer import Trainer

    spec = build.build_spec(one_process(config))
    check_run_config(spec.config, run)
    ckpt = Checkpointer(run, keep=1_000_000)  # read only: keep deletes nothing without a save
    have = set(ckpt.all_steps())
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(spec, scratch, resume=False)  # version 0: the config's initial parameters
        try:
            L = trainer.learner
            initial = jax.tree.map(lambda x: x.copy(), L.params)
            run_eps = None
            if have:
                _, _, _, meta = ckpt.restore(min(have), L.params, L.opt_state)
                run_eps = meta.get("epsilon")
            eps = epsilon or run_eps or spec.estimator.epsilon

            def load(v):
                L.params = initial if v == 0 else ckpt.restore(v, L.params, L.opt_state)[0]
                L.sync_local()

            load(batch_version)
            cursor = batch_version * spec.num_groups  # the run's task cursor at that iteration
            groups = [
                tasks.train_task(trainer.train_ids, spec.seed, cursor + i) for i in range(trainer.groups_per_host)
            ]
            t0 = time.perf_counter()
            res = collect(
                trainer.actor,
                trainer.engine,
                trainer.pool,
                groups,
                spec.rollout,
                _iteration_key(spec.seed, batch_version),
            )
            replay_s = time.perf_counter() - t0
            n = res.tokens.rows
            ids, mask = np.asarray(res.prompt_ids), np.asarray(res.prompt_mask)
            # equal prompts have equal fingerprints: one forward per distinct prompt
            digests = [hashlib.sha256(ids[r][mask[r] == 1].astype(np.int32).tobytes()).digest() for r in range(n)]
            _, first, prompt_key = np.unique(digests, return_index=True, return_inverse=True)
            prompt_key = prompt_key.reshape(-1)
            fps, fp_s = {}, 0.0
            for v in versions:
                load(v)
                t0 = time.perf_counter()
                fps[v] = prompt_fingerprints(trainer.actor, ids[first], mask[first], kw["chunk"])[prompt_key]
                fp_s += time.perf_counter() - t0
            sampler_fp = np.asarray(res.steps.fingerprint, np.float32)[:n]
            gap = one_minus_cos(fps[batch_version], sampler_fp)
            configs = {
                name: dataclasses.replace(spec.estimator_at(eps), name=name, similarity_thresh=0.0) for name in names
            }
            t0 = time.perf_counter()
            report = drift_report(fps, res.steps, n, prompt_key, configs, splits=kw["splits"], seed=kw["seed"])
            clusters_s = time.perf_counter() - t0
            success = float(np.mean([e.won for e in res.episodes]))
            match = _transcript_match(run, batch_version, res)
        finally:
            trainer.close()
    from bipace_jax.lab import config as lab_config

    lab = lab_config.default_config()
    drifts = [float(d) for d in lab_config.parse_list(lab, "grid.drifts")]
    add_lab_units(report, eps, float(lab.estimator.epsilon))
    t0 = time.perf_counter()
    if kw["lab_seeds"]:
        add_lab_comparison(report, names, drifts, kw["lab_seeds"])
    lab_s = time.perf_counter() - t0
    report.update(
        epsilon=float(eps),
        batch_version=batch_version,
        batch_success_rate=success,
        transcript_match=match,
        fingerprint_gap_max=float(gap.max()),
        versions=versions,
        estimators=names,
        lab={
            "epsilon": float(lab.estimator.epsilon),
            "paraphrases": int(lab.grid.stale_paraphrases),
            "sigma": float(lab.grid.paraphrases_at_sigma),
            "seeds": kw["lab_seeds"],
            "drifts": {
                float(d): {
                    "one_minus_cos_lag1": lab_one_minus_cos(float(d), 1),
                    "over_epsilon_lag1": lab_one_minus_cos(float(d), 1) / float(lab.estimator.epsilon),
                }
                for d in drifts
            },
        },
        seconds={"replay": replay_s, "fingerprints": fp_s, "clusters": clusters_s, "lab": lab_s},
    )
    return report


# ---------------------------------------------------------------------------------------------------
# Output.


def table(report: dict) -> str:
    """The markdown table of ``report``: one row per lag (drift, its lab units, membership changes)."""
    names = report["estimators"]
    lab = bool(report["lab"]["seeds"])
    head = ["lag", "pairs", "1-cos mean", "median", "p90", "mean / eps", "lab drift", "at lab eps"]
    for n in names:
        head += [f"{n} mixed changed", f"{n} pure changed"] + ([f"{n} lab drift, same change"] if lab else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d, s in report["lags"].items():
        cells = [f"{d}", f"{s['pairs']}", f"{s['mean']:.2e}", f"{s['median']:.2e}", f"{s['p90']:.2e}"]
        cells += [f"{s['mean_over_epsilon']:.2f}", f"{s['lab_drift']:.4f}", f"{s['lab_drift_at_lab_epsilon']:.3f}"]
        for n in names:
            cells += [f"{100 * s[f'{n}/mixed_changed']:.1f}%", f"{100 * s[f'{n}/pure_changed']:.1f}%"]
            cells += [f"{s['lab_drift_same_change'][n]:.3f}"] if lab else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def update_table(report: dict) -> str:
    """The markdown table of each update's own drift: the pairs (v, v + 1) (the smallest lag measured)."""
    names, lag = report["estimators"], min(report["lags"])
    head = ["v", "1-cos mean", "mean / eps", "at lab eps"] + [f"{n} mixed changed" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratio = report["lab"]["epsilon"] / report["epsilon"]
    for p in (p for p in report["pairs"] if p["lag"] == lag):
        cells = [f"{p['old']} -> {p['new']}", f"{p['mean']:.2e}", f"{p['mean'] / report['epsilon']:.2f}"]
        cells += [f"{lab_drift(p['mean'] * ratio, lag):.3f}"] + [f"{100 * p[n]['mixed_changed']:.1f}%" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted(report["lags"])
    fig, (a, b, u) = plt.subplots(1, 3, figsize=(15, 3.8))
    for k, style in (("mean", "o-"), ("median", "s--"), ("p90", "^:")):
        a.plot(lags, [report["lags"][d][k] for d in lags], style, label=f"real, {k}")
    for d_lab in report["lab"]["drifts"]:
        a.plot(lags, [lab_one_minus_cos(float(d_lab), d) for d in lags], color="gray", lw=0.8)
        a.annotate(
            f"lab {float(d_lab):g}", (lags[-1], lab_one_minus_cos(float(d_lab), lags[-1])), fontsize=7, color="gray"
        )
    ratio = report["epsilon"] / report["lab"]["epsilon"]  # the lab's curves in the run's epsilons
    for d_lab in report["lab"]["drifts"]:
        y = [ratio * lab_one_minus_cos(float(d_lab), d) for d in lags]
        a.plot(lags, y, color="tab:purple", lw=0.8, ls=":")
        a.annotate(f"lab {float(d_lab):g} x eps ratio", (lags[-1], y[-1]), fontsize=7, color="tab:purple")
    a.axhline(report["epsilon"], color="red", lw=0.8, ls="--", label=f"run epsilon {report['epsilon']:g}")
    a.set_yscale("log")
    a.set_xlabel("version lag d")
    a.set_ylabel("1 - cos(f_v, f_v+d)")
    a.legend(fontsize=7)
    for n in report["estimators"]:
        b.plot(lags, [100 * report["lags"][d][f"{n}/mixed_changed"] for d in lags], "o-", label=f"{n}, mixed v / v+d")
        b.plot(
            lags, [100 * report["lags"][d][f"{n}/pure_changed"] for d in lags], "s--", label=f"{n}, all v vs all v+d"
        )
    if report["lab"]["seeds"]:
        n = report["estimators"][0]
        for x, style in zip(report["lab"]["drifts"], (":", "-.", "--")):
            key = f"{float(x):g}"
            y = [100 * report["lags"][d]["lab_mixed_changed"][key][n] for d in lags]
            b.plot(lags, y, color="gray", lw=1, ls=style, label=f"lab drift {key}, {n}, mixed")
    b.set_xlabel("version lag d")
    b.set_ylabel("rows whose step group changed (%)")
    b.set_ylim(bottom=0)
    b.legend(fontsize=7)
    steps = [p for p in report["pairs"] if p["lag"] == min(lags)]  # each update's own drift
    u.plot([p["old"] for p in steps], [p["mean"] / report["epsilon"] for p in steps], "o-", label="1 - cos mean / eps")
    for n in report["estimators"]:
        u.plot([p["old"] for p in steps], [p[n]["mixed_changed"] for p in steps], "s--", label=f"{n}, mixed, fraction")
    u.set_xlabel(f"version v (pair v, v + {min(lags)})")
    u.set_ylim(bottom=0)
    u.set_title("per update", fontsize=8)
    u.legend(fontsize=7)
    fig.suptitle(
        f"fingerprint drift per policy version (batch of version {report['batch_version']}, {report['rows']} rows)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finite_json(obj):
    """``obj`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def checkpoint_steps(run: str) -> list[int]:
    """The committed checkpoint steps of ``run`` (``checkpoints/<step>`` folders), ascending."""
    folder = os.path.join(run, "checkpoints")
    return sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if os.path.isdir(folder) else []


def parse_versions(text: str, run: str) -> list[int]:
    """``--versions``: sorted distinct ints >= 0, each 0 or a checkpoint of ``run``; '' = 0 and every
    checkpoint. Raises ValueError naming the flag otherwise."""
    have = checkpoint_steps(run)
    if not text.strip():
        return [0] + [s for s in have if s > 0]
    try:
        out = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        out = []
    if not out or out[0] < 0:
        raise ValueError(f"--versions: expected comma-separated ints >= 0, got {text!r}")
    missing = [v for v in out if v > 0 and v not in have]
    if missing:
        raise ValueError(f"--versions: {missing} are not checkpoints of {run} (it has {have})")
    return out


def check_args(run, versions, batch_version, estimators, splits, chunk, epsilon) -> tuple[list[int], list[str]]:
    """(versions, estimator names) from the flags' values; raises ValueError naming the first bad flag,
    before JAX is imported (the estimator names last: the registry imports it)."""
    if not run:
        raise ValueError("--run: expected a run folder with checkpoints (python -m launch.train --workdir=...), got ''")
    if not os.path.isfile(os.path.join(run, "config.json")):
        raise ValueError(f"--run: {run!r} is not a run folder (no config.json)")
    versions = parse_versions(versions, run)
    if len(versions) < 2:
        raise ValueError(f"--versions: need at least two versions, got {versions} (does {run} hold checkpoints?)")
    if batch_version not in versions:
        raise ValueError(f"--batch_version: expected one of the versions {versions}, got {batch_version}")
    for flag, value in (("splits", splits), ("chunk", chunk)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"--{flag}: expected an int >= 1, got {value}")
    if not 0 <= epsilon < 1:
        raise ValueError(f"--epsilon: expected 0 (the run's) or a float in (0, 1), got {epsilon}")
    from bipace_jax.estimators import registry

    names = [n.strip() for n in estimators.split(",") if n.strip()]
    known = [n for n in registry.names() if registry.get(n).clusters]
    if not names or any(n not in known for n in names):
        raise ValueError(f"--estimators: expected clustering estimators among {known}, got {estimators!r}")
    return versions, names


def check_out(out: str) -> None:
    """Create the ``--out`` folder now, so a bad one stops the command before the model loads (the
    report is written after minutes of replay). Raises ValueError naming ``--out``."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: expected a folder, got the file {out!r}")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out: cannot create the folder {out!r}: {e.strerror}") from None


def main(argv):
    del argv
    from launch._common import cpu_unless_accelerator, no_bars_off_terminal

    cpu_unless_accelerator()
    no_bars_off_terminal()
    if not flags.FLAGS["verbosity"].present:  # orbax/absl INFO lines drown the table
        logging.set_verbosity(logging.WARNING)
    run = _RUN.value
    try:
        versions, names = check_args(
            run, _VERSIONS.value, _BATCH_VERSION.value, _ESTIMATORS.value, _SPLITS.value, _CHUNK.value, _EPSILON.value
        )
        if _LAB_SEEDS.value < 0:
            raise ValueError(f"--lab_seeds: expected an int >= 0 (0 = no lab comparison), got {_LAB_SEEDS.value}")
        out = _OUT.value or os.path.join(run, "fingerprint_drift")
        check_out(out)
    except ValueError as e:
        cli.fail(str(e))
    from bipace_jax.config import ConfigError

    t0, load_start = time.perf_counter(), list(os.getloadavg())
    try:
        report = measure(
            _CONFIG.value,
            run,
            versions,
            _BATCH_VERSION.value,
            names,
            _EPSILON.value,
            splits=_SPLITS.value,
            seed=_SEED.value,
            chunk=_CHUNK.value,
            lab_seeds=_LAB_SEEDS.value,
        )
    except ConfigError as e:
        cli.fail(str(e))
    report["provenance"] = {
        "commit": _git_commit(),
        "command": "python -m launch.fingerprint_drift " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - t0,
        "run": run,
    }
    report["lags"] = {str(d): s for d, s in report["lags"].items()}
    os.makedirs(out, exist_ok=True)
    report_int = dict(report, lags={int(d): s for d, s in report["lags"].items()})
    print(table(report_int))
    print(update_table(report_int))
    print(
        f"epsilon {report['epsilon']:g}, fingerprint gap to the sampler {report['fingerprint_gap_max']:.1e}, "
        f"transcript match {report['transcript_match']}"
    )
    with open(os.path.join(out, "drift.json"), "w") as f:
        json.dump(finite_json(report), f, indent=2)
    plot(report_int, os.path.join(out, "drift.png"))
    print(f"wrote {out}/drift.json, drift.png")


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
