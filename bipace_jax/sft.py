"""Warm start: behaviour cloning and DAgger on a game's oracle, through the RL loop's own pieces.

``run(config, workdir, out)`` decodes the config (``build_warm_start``: the sections shared with RL
carry RL's names), builds the tokenizer (``tiny.warm_start_tokenizer``, unless ``config.model.tokenizer``
names one); encodes one ``Example`` per record of the oracle's demonstrations (``bipace_demos``) on the
training goals (``record_example``: the prompt as ``rollout.encode_prompt`` encodes it, the response
``<action>{action}</action>`` + ``<|im_end|>``); trains a fresh tiny Qwen2 with ``learner.Learner`` and
``ResponseNLL`` (token-mean NLL of the response tokens); runs DAgger rounds (the policy plays through
``rollout.collect`` with the oracle as ``labeler``; every visited state becomes a record of the same
schema in ``<workdir>/dagger_<round>.jsonl``, encoded by the same ``record_example``); validates on
``tasks.validation_panel`` and writes the Hugging Face folder ``out``. Run folder, resumption and determinism: docs/warm_start.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from flax import nnx
from tqdm import tqdm

import environments
from bipace_jax import demos, losses, metric_keys, resume, runfolder, tasks
from bipace_jax.build import checked
from bipace_jax.checkpointing import Checkpointer, CheckpointMeta
from bipace_jax.config import (
    EnvConfig,
    OptimConfig,
    Section,
    TasksConfig,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_str,
    fail,
    get,
    resolve_template,
    system_prompt_of,
)
from bipace_jax.demo_stream import BucketStream
from bipace_jax.learner import Learner, shard_rows, step_specs
from bipace_jax.metrics import MetricsLogger, read_metrics
from bipace_jax.models import Qwen2Actor, load_tokenizer, save_hf_checkpoint
from bipace_jax.rollout import Episode, RolloutConfig, RolloutResult, collect, encode_prompt
from bipace_jax.sampling import Engine, SamplerConfig
from bipace_jax.sharding import make_mesh
from bipace_jax.tiny import ACTION_RESPONSE, oracle_steps, tiny_actor_config, warm_start_tokenizer
from environments.pool import EnvPool

# -------------------------------------------------------------------------------------------------
# Examples: the RL loop's prompt/response format.


@dataclasses.dataclass
class Example:
    """One behaviour-cloning example: the chat-formatted prompt's token ids and the target response's;
    ``key`` names it (``<task>_<seed>_<turn>``: the dataset's record key; ``dagger<round>_<row>``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    depth: int = 0
    source: str = "expert"
    key: str = ""


def encode_response(tokenizer, action: str) -> list[int]:
    """Token ids of ``<action>{action}</action>`` followed by the end-of-turn token ``<|im_end|>``."""
    ids = tokenizer(ACTION_RESPONSE.format(action=action), add_special_tokens=False)["input_ids"]
    return list(ids) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def expert_examples(env, rcfg: RolloutConfig, tokenizer, pairs: Sequence[tuple[int, int]]):
    """The oracle's episodes on each (task_id, seed) as examples; returns (examples, stats).

    Raises:
      RuntimeError: the oracle has no action before the episode ends (it must always have a plan).
    """
    examples, wins = [], 0
    for s in oracle_steps(env, pairs, rcfg.max_steps):
        if s.action is None:
            raise RuntimeError(f"oracle has no action for task {s.task_id} seed {s.seed} at step {s.step}")
        ids, _ = encode_prompt(tokenizer, rcfg, s.obs, list(s.history), s.step, f"task {s.task_id} seed {s.seed}")
        depth = int(env.task_info(s.task_id).get("depth", 0))
        key = f"{s.task_id}_{s.seed}_{s.step}"
        examples.append(Example(ids, encode_response(tokenizer, s.action), depth, "expert", key))
        wins += bool(s.next_obs.won)
    n = max(len(pairs), 1)
    return examples, {"oracle_win_rate": wins / n, "oracle_mean_length": len(examples) / n}


def record_example(r, rcfg: RolloutConfig, tokenizer) -> Example:
    """The example of one demonstration record: a ``bipace_demos`` record (a ``demos.read_split`` row,
    key ``<task>_<seed>_<turn>``, source ``"expert"``) or a DAgger record (``dagger_records``, key
    ``dagger<round>_<row>``, source ``"dagger"``). The one record -> example encoding of the warm start:
    the prompt as ``rollout.encode_prompt`` encodes the record's observation, history and turn (what the
    RL loop feeds the sampler), the response ``encode_response`` of its oracle action.

    Raises:
      PromptTooLongError: the prompt exceeds ``rcfg.max_prompt_length`` even with no history.
    """
    task, seed, turn = int(r["task_id"]), int(r["seed"]), int(r["turn"])
    ids, _ = encode_prompt(
        tokenizer, rcfg, demos.observation_of(r), demos.history_of(r), turn, f"task {task} seed {seed}"
    )
    action = r["action"].decode() if isinstance(r["action"], bytes) else str(r["action"])
    if "round" in r:
        source, key = "dagger", f"dagger{int(r['round'])}_{int(r['row'])}"
    else:
        source, key = "expert", f"{task}_{seed}_{turn}"
    return Example(ids, encode_response(tokenizer, action), int(r["depth"]), source, key)


def demo_examples(records, rcfg: RolloutConfig, tokenizer) -> tuple[list[Example], dict[str, float]]:
    """Examples of a ``demos.read_split`` source (record order, ``record_example``); returns (examples,
    oracle stats: the share of its episodes won and their mean length in records)."""
    examples, won = [], {}
    for r in records:
        examples.append(record_example(r, rcfg, tokenizer))
        won[(int(r["task_id"]), int(r["seed"]))] = bool(r["won"])
    n = max(len(won), 1)
    return examples, {"oracle_win_rate": sum(won.values()) / n, "oracle_mean_length": len(examples) / n}


def expert_dataset(spec, data_dir: str, progress: bool = False) -> demos.DemosBuilder:
    """The warm start's demonstrations (``bipace_demos``) built under ``data_dir`` on first use: its
    training goals x ``data.expert_seeds`` in ``train``, its held-out goals in ``validation``."""
    cfg = demos.demos_config(
        spec.env.name,
        tasks=spec.tasks.train,
        holdout_every=spec.tasks.holdout_every,
        seeds=spec.data.expert_seeds,
        max_steps=spec.env.max_steps,
    )
    return demos.build(cfg, data_dir, progress=progress)


def dagger_records(res: RolloutResult, rnd: int, game: str) -> list[dict[str, Any]]:
    """The labelled rows of a ``collect`` (DAgger round ``rnd`` of ``game``) as demonstration records
    (``demos.FIELDS`` + ``round``, ``row``), in row order; rows the oracle has no action for are left out.

    Each record holds the state the row's prompt showed (``res.states[row]``), its history (the earlier
    rows of its trajectory: observation text and the action sent, as ``collect`` built the prompt), its
    turn, and the oracle's label as ``action``; ``won`` is whether the policy's game was won, ``oracle``
    ``demos.oracle_version(game)``. ``record_example`` of a record gives the row's prompt tokens exactly.

    Raises:
      ValueError: ``res`` has no labels or states (not a labelled ``collect``), or a trajectory's rows are
        not its steps 0, 1, ... in order.
    """
    if res.labels is None or len(res.states) != res.rows:
        raise ValueError("dagger_records needs a RolloutResult of collect(..., labeler=...) with its states")
    traj, step = np.asarray(res.steps.traj_id)[: res.rows], np.asarray(res.steps.step)[: res.rows]
    oracle, out = demos.oracle_version(game), []
    history: dict[int, list[tuple[str, str]]] = {}
    for r, label in enumerate(res.labels):
        t = int(traj[r])
        past = history.setdefault(t, [])
        if int(step[r]) != len(past):
            raise ValueError(f"row {r}: trajectory {t} step {int(step[r])} follows {len(past)} earlier rows")
        if label is not None:
            ep = res.episodes[t]
            depth = int(ep.task_info.get("depth", 0))
            out.append(
                demos.record(
                    game,
                    ep.task_id,
                    ep.seed,
                    step[r],
                    depth,
                    res.states[r],
                    past,
                    label,
                    ep.won,
                    oracle,
                    round=rnd,
                    row=r,
                )
            )
        past.append((res.observations[r], res.actions[r]))
    return out


def summarize(episodes: Sequence[Episode], heldout: set[int] = frozenset()) -> dict[str, float]:
    """Success rates: overall, by depth, seen vs held-out goals; mean length and invalid rate."""

    def rate(eps):
        return float(np.mean([e.won for e in eps])) if eps else float("nan")

    def depth(e):
        return int(e.task_info.get("depth", 0))

    out: dict[str, float] = {"success": rate(episodes), "n": len(episodes)}
    for d in sorted({depth(e) for e in episodes}):
        out[f"success_depth{d}"] = rate([e for e in episodes if depth(e) == d])
    held = [e for e in episodes if e.task_id in heldout]
    out["success_seen"] = rate([e for e in episodes if e.task_id not in heldout])
    if held:
        out["success_heldout"] = rate(held)
        for d in sorted({depth(e) for e in held}):
            out[f"success_heldout_depth{d}"] = rate([e for e in held if depth(e) == d])
    steps = sum(e.length for e in episodes)
    out["mean_length"] = steps / len(episodes) if episodes else 0.0
    out["invalid_rate"] = sum(e.invalid_count for e in episodes) / max(steps, 1)
    return out


# -------------------------------------------------------------------------------------------------
# Batching: fixed batch size and length buckets so the train step compiles a few times only.


@flax.struct.dataclass
class SFTBatch:
    """B right-padded rows: T tokens, R response targets (the columns that predict them)."""

    input_ids: jax.Array  # int32[B, T]
    attention_mask: jax.Array  # int32[B, T]
    positions: jax.Array  # int32[B, R], column t predicts token t + 1
    targets: jax.Array  # int32[B, R]
    target_mask: jax.Array  # float32[B, R], 1 on real response tokens


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises ValueError naming the longest bucket when n exceeds it."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(
        f"sequence of {n} tokens exceeds the longest length bucket {buckets[-1]}; raise config.data.length_buckets"
    )


def make_batch(examples: Sequence[Example], length: int, pad_id: int, response_length: int) -> SFTBatch:
    """NumPy ``SFTBatch`` of the examples padded to ``length`` tokens and ``response_length`` targets.

    Raises:
      ValueError: an example longer than ``length`` or a response longer than ``response_length``.
    """
    b = len(examples)
    ids = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.int32)
    pos = np.zeros((b, response_length), np.int32)
    tgt = np.full((b, response_length), pad_id, np.int32)
    tmask = np.zeros((b, response_length), np.float32)
    for r, ex in enumerate(examples):
        seq = ex.prompt_ids + ex.response_ids
        n, p, m = len(seq), len(ex.prompt_ids), len(ex.response_ids)
        if n > length:
            raise ValueError(f"example of {n} tokens does not fit the length bucket {length}")
        if m > response_length:
            raise ValueError(f"response of {m} tokens exceeds config.data.response_length={response_length}")
        ids[r, :n], mask[r, :n] = seq, 1
        pos[r, :m] = np.arange(p - 1, n - 1)
        tgt[r, :m], tmask[r, :m] = ex.response_ids, 1.0
    return SFTBatch(ids, mask, pos, tgt, tmask)


def batches(
    examples: Sequence[Example], batch_size: int, buckets: Sequence[int], rng: np.random.Generator
) -> Iterator[tuple[int, list[Example]]]:
    """Endless (length bucket, examples) batches: a ``demo_stream.BucketStream`` over ``examples`` (this
    process's shard, a new shuffle every epoch seeded from ``rng``), ``batch_size`` of one bucket each."""
    seed = int(rng.integers(2**31))
    return BucketStream(
        list(examples),
        lambda e: e,
        lambda e: len(e.prompt_ids) + len(e.response_ids),
        batch_size,
        buckets,
        seed,
    )


# -------------------------------------------------------------------------------------------------
# The loss, a ``learner.LossFn``.


def token_nll(logits, targets, mask, denom=None):
    """(sum of the NLL of ``targets`` on ``mask`` / ``denom``, argmax accuracy on the same tokens / ``denom``).

    logits float32[B,R,V], targets int32[B,R], mask float32[B,R]; ``denom`` defaults to ``mask.sum()``
    (the token mean); a batch's real-token count makes micro-batch sums its exact token mean.
    """
    nll = -losses.token_logprobs(logits, targets)
    acc = jnp.argmax(logits, axis=-1) == targets
    return losses.token_mean(nll, mask, denom), losses.token_mean(acc, mask, denom)


@dataclasses.dataclass(frozen=True)
class ResponseNLL:
    """The behaviour-cloning loss of an ``SFTBatch``: the LM head runs at the response columns only."""

    def __call__(self, model, mb: SFTBatch, denom):
        h, _ = model.forward_hidden(mb.input_ids, mb.attention_mask)
        h = jnp.take_along_axis(h, mb.positions[..., None], axis=1)
        loss, acc = token_nll(model.lm_logits(h), mb.targets, mb.target_mask, denom)
        return loss, {"token_accuracy": acc}


def train_step(learner: Learner, batch: SFTBatch, micro_rows: int, where: str = "") -> dict[str, float]:
    """One optimizer step on a NumPy batch split into ``micro_rows``-row micro-batches (0: one)."""
    b = batch.input_ids.shape[0]
    micro_rows = micro_rows or b
    micros = (
        shard_rows(learner.mesh, jax.tree.map(lambda x, s=s: x[s : s + micro_rows], batch))
        for s in range(0, b, micro_rows)
    )
    denom = float(max(batch.target_mask.sum(), 1.0))
    stats, gnorm = learner.step(ResponseNLL(), micros, denom, ("token_accuracy",), where=where)
    return dict(stats, grad_norm=gnorm)


def abstract_sft_batch(mesh, rows: int, length: int, response_length: int) -> SFTBatch:
    """An ``SFTBatch`` of ``jax.ShapeDtypeStruct``s: ``rows`` rows of ``length`` tokens and
    ``response_length`` targets, rows split over the mesh's ("data", "fsdp") axes as ``shard_rows`` places them."""
    rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding)

    r = response_length
    i32 = jnp.int32
    return SFTBatch(
        sds((rows, length), i32),
        sds((rows, length), i32),
        sds((rows, r), i32),
        sds((rows, r), i32),
        sds((rows, r), jnp.float32),
    )


def sft_step_specs(graphdef, tx, mesh, params, rest, opt_state, rows: int, length: int, response_length: int):
    """The warm start's optimizer step as ``ProgramSpec``s (``learner.step_specs`` with ``ResponseNLL``):
    ``"accumulate"`` on one ``rows``-row micro-batch of ``length`` tokens (the longest length bucket) and
    ``response_length`` targets, and ``"apply"``; for ``launch.aot`` (params/rest/opt_state abstract,
    with their shardings, as for the RL step)."""
    mb = abstract_sft_batch(mesh, rows, length, response_length)
    return step_specs(graphdef, ResponseNLL(), tx, mesh, params, rest, opt_state, mb, ("token_accuracy",))


# -------------------------------------------------------------------------------------------------
# The run.


def dagger_file(run_dir: epath.Path, rnd: int) -> epath.Path:
    """Round ``rnd``'s DAgger records in the run folder (``demos.write_records``' JSON lines)."""
    return run_dir / f"dagger_{rnd}.jsonl"


def read_dagger_examples(run_dir: epath.Path, rnd: int, rcfg: RolloutConfig, tokenizer) -> list[Example]:
    """``record_example`` of each of round ``rnd``'s DAgger records in the run folder, in record order.

    Raises:
      ValueError: the round's file (``dagger_file``) does not exist (the message says when the folder holds
        ``dagger_<round>.json`` instead, the token-id format of older versions, which is not read), or a
        record lacks a field.
    """
    path = dagger_file(run_dir, rnd)
    if not path.exists():
        old = run_dir / f"dagger_{rnd}.json"
        why = (
            f"the folder holds {old.name}, the token-id format of an older version, which is not read"
            if old.exists()
            else "the run folder lost it"
        )
        raise ValueError(f"DAgger round {rnd} is finished but {path} does not exist ({why}): start a new --workdir")
    records = demos.read_records(path, demos.FIELDS + demos.DAGGER_FIELDS)
    return [record_example(r, rcfg, tokenizer) for r in records]


#: ``config.train.log_examples``' file in the run folder: one JSON line per update.
EXAMPLES_FILE = "examples.jsonl"


class _ExampleLog:
    """``examples.jsonl``: ``{"update", "round", "examples": [Example.key, ...]}`` per update, in order.

    Lines past ``start_update`` (updates a resumed run does again) are dropped when it opens, so the
    file names exactly the examples the weights were trained on. Rewritten whole by ``flush`` (runfolder).
    """

    def __init__(self, path: epath.Path, start_update: int):
        self.path = path
        lines = (runfolder.read_text(path) or "").splitlines()
        self.lines = [x for x in lines if x.strip() and json.loads(x)["update"] <= start_update]
        self.flush()

    def add(self, update: int, rnd: int, keys: list[str]) -> None:
        self.lines.append(json.dumps({"update": update, "round": rnd, "examples": keys}))

    def flush(self) -> None:
        runfolder.write_text(self.path, "".join(x + "\n" for x in self.lines))


# -------------------------------------------------------------------------------------------------
# The warm start's spec: its sections carry RL's names (configs/base.py) where they mean the same.


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """``config.data``: oracle games per goal, the examples' length buckets and response length, and the
    oracle games per goal of a built tokenizer's corpus."""

    SECTION: ClassVar[str] = "data"
    expert_seeds: int = 24
    length_buckets: tuple[int, ...] = (160, 224, 288, 384, 448)
    response_length: int = 32
    tokenizer_seeds: int = 2

    def __post_init__(self):
        check_int(self._name("expert_seeds"), self.expert_seeds, 1)
        b = tuple(self.length_buckets)
        if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(b):
            fail(self._name("length_buckets"), "be a non-empty ascending tuple of ints >= 1", b)
        object.__setattr__(self, "length_buckets", b)
        check_int(self._name("response_length"), self.response_length, 1)
        check_int(self._name("tokenizer_seeds"), self.tokenizer_seeds, 1)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """``config.train``: batch rows (split in ``micro_batch_rows``, 0 = one), updates before and after
    each DAgger round, metrics every ``log_every`` updates, a checkpoint every ``checkpoint_every``
    updates inside a round (0 = at round ends only; a multiple of ``log_every``), and with
    ``log_examples`` the keys of every update's examples in ``<workdir>/examples.jsonl``."""

    SECTION: ClassVar[str] = "train"
    batch_size: int = 32
    micro_batch_rows: int = 0
    bc_steps: int = 600
    steps_per_round: int = 100
    log_every: int = 25
    checkpoint_every: int = 0
    log_examples: bool = False

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            fail(self._name("batch_size"), "be >= 1", self.batch_size)
        m = self.micro_batch_rows
        if isinstance(m, bool) or not isinstance(m, int) or m < 0 or self.batch_size % (m or 1):
            fail(self._name("micro_batch_rows"), "be >= 0 and divide train.batch_size", m)
        check_int(self._name("bc_steps"), self.bc_steps, 0)
        check_int(self._name("steps_per_round"), self.steps_per_round, 0)
        check_int(self._name("log_every"), self.log_every, 1)
        check_int(self._name("checkpoint_every"), self.checkpoint_every, 0)
        if self.checkpoint_every % self.log_every:
            # a resume then starts a fresh metrics window exactly where the uninterrupted run did
            fail(
                self._name("checkpoint_every"),
                f"be 0 or a multiple of train.log_every={self.log_every}",
                self.checkpoint_every,
            )
        check_bool(self._name("log_examples"), self.log_examples)


@dataclasses.dataclass(frozen=True)
class DaggerConfig(Section):
    """``config.dagger``: rounds, policy games per round, their temperature (0 = greedy) and seeds."""

    SECTION: ClassVar[str] = "dagger"
    rounds: int = 4
    episodes: int = 128
    temperature: float = 0.4
    seed_base: int = 100_000

    def __post_init__(self):
        check_int(self._name("rounds"), self.rounds, 0)
        check_int(self._name("episodes"), self.episodes, 1)
        check_float(self._name("temperature"), self.temperature, 0)
        check_int(self._name("seed_base"), self.seed_base, 0)


@dataclasses.dataclass(frozen=True)
class PanelConfig(Section):
    """``config.val`` of the warm start: the RL default's panel (``tasks.validation_panel``, "spread")
    over every ``rl_every``-th training goal and the held-out goals; ``temperature`` 0 = greedy."""

    SECTION: ClassVar[str] = "val"
    rl_every: int = 4
    num_tasks: int = 18
    num_holdout_tasks: int = 10
    seeds_per_goal: int = 3
    temperature: float = 0.4
    seed: int = 1_000_000
    every_round: bool = False

    def __post_init__(self):
        check_int(self._name("rl_every"), self.rl_every, 1)
        check_int(self._name("num_tasks"), self.num_tasks, 0)
        check_int(self._name("num_holdout_tasks"), self.num_holdout_tasks, 0)
        check_int(self._name("seeds_per_goal"), self.seeds_per_goal, 1)
        check_float(self._name("temperature"), self.temperature, 0)
        check_int(self._name("seed"), self.seed, 0)
        check_bool(self._name("every_round"), self.every_round)


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
    """The warm start, decoded and checked (``build_warm_start``).

    Attributes:
      seed: model init, data order, DAgger seeds.
      tokenizer: tokenizer folder ("" = build the project's BPE); ``vocab_size``: its learned entries.
      actor: the tiny Qwen2 architecture (its vocabulary is set from the tokenizer by ``run``).
      env, tasks, sampler, optim: as RL's sections (``config.EnvConfig``, ``config.TasksConfig``,
        ``SamplerConfig`` at temperature 1, ``config.OptimConfig``).
      rollout: how every game is played (one per task group; the RL default's prompt settings).
      data, train, dagger, val: the warm start's own sections.
      config: the checked source config (a ``FrozenConfigDict``; written to ``report.json``).
    """

    seed: int
    tokenizer: str
    vocab_size: int
    actor: Any
    env: EnvConfig
    tasks: TasksConfig
    rollout: RolloutConfig
    sampler: SamplerConfig
    optim: OptimConfig
    data: DataConfig
    train: TrainConfig
    dagger: DaggerConfig
    val: PanelConfig
    config: Any = dataclasses.field(repr=False, compare=False)

    def sampler_at(self, temperature: float) -> SamplerConfig:
        """``sampler`` at ``temperature`` (0 = greedy)."""
        return dataclasses.replace(self.sampler, temperature=temperature or 1.0, greedy=temperature == 0)

    @property
    def total_updates(self) -> int:
        return self.train.bc_steps + self.dagger.rounds * self.train.steps_per_round


# config.model field -> its Qwen2Config field (as RL's tiny preset, build.actor_architecture)
_TINY_SIZES = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
}


def build_warm_start(c) -> WarmStartSpec:
    """Check every field of a warm-start config (``configs/sft_textcraft_tiny.py``) and decode it.

    Raises:
      ConfigError: (a ``ValueError``) naming the first bad field, before anything loads or compiles.
    """
    seed = check_int("seed", get(c, "seed"), 0)
    tokenizer = check_str("model.tokenizer", get(c, "model.tokenizer"), "a path string ('' = build one)")
    vocab_size = check_int("model.vocab_size", get(c, "model.vocab_size"), 300)
    sizes = {hf: check_int(f"model.{f}", get(c, f"model.{f}"), 1) for f, hf in _TINY_SIZES.items()}
    env = EnvConfig.from_config(c, ("name", "max_steps", "num_workers"))
    check_choice("env.name", env.name, environments.registered())
    tasks_cfg = TasksConfig.from_config(c, ("train", "holdout_every"))
    s = c.sampler
    sampler = checked(
        "sampler",
        SamplerConfig,
        max_new_tokens=get(c, "sampler.max_new_tokens"),
        batch_buckets=tuple(s.batch_buckets),
        length_buckets=tuple(s.length_buckets),
    )
    r = c.rollout
    rollout = checked(
        "rollout",
        RolloutConfig,
        game=env.name,
        group_size=1,
        max_steps=env.max_steps,
        history_length=get(c, "rollout.history_length"),
        max_prompt_length=sampler.length_buckets[-1],
        fallback_action=r.fallback_action or None,  # "" = the game's own
        show_inventory=r.show_inventory,
        system_prompt=system_prompt_of(check_str("rollout.system_prompt", r.system_prompt)),
        template=resolve_template(r.template),
    )
    return WarmStartSpec(
        seed=seed,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        actor=sizes,
        env=env,
        tasks=tasks_cfg,
        rollout=rollout,
        sampler=sampler,
        optim=OptimConfig.from_config(c),
        data=DataConfig.from_config(c),
        train=TrainConfig.from_config(c),
        dagger=DaggerConfig.from_config(c),
        val=PanelConfig.from_config(c),
        config=ml_collections.FrozenConfigDict(c),
    )


def validate_config(c) -> None:
    """``build_warm_start`` for its checks only; raises ``ConfigError`` (a ``ValueError``)."""
    build_warm_start(c)


def make_optimizer(spec) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; linear warmup to ``optim.learning_rate``, cosine to 10% at the
    last update. ``spec``: a ``WarmStartSpec`` (or a warm-start config, built into one)."""
    spec = spec if isinstance(spec, WarmStartSpec) else build_warm_start(spec)
    o, total = spec.optim, spec.total_updates
    lr = optax.warmup_cosine_decay_schedule(
        0.0, o.learning_rate, o.warmup_steps, max(total, o.warmup_steps + 1), end_value=0.1 * o.learning_rate
    )
    adamw = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw)


def rollout_config(c) -> RolloutConfig:
    """How the warm start plays (one game per panel task, the RL loop's prompt settings)."""
    return build_warm_start(c).rollout


# -------------------------------------------------------------------------------------------------
# The run: tokenizer -> tasks and expert data -> learner (restored) -> BC + DAgger rounds -> report.


def _tokenizer(spec: WarmStartSpec, run_dir: epath.Path):
    """The tokenizer of ``spec.tokenizer``, else the one built into ``<run_dir>/tokenizer`` (built once)."""
    tok_dir = runfolder.path(spec.tokenizer, "config.model.tokenizer") if spec.tokenizer else run_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        with runfolder.staged(tok_dir) as local:
            warm_start_tokenizer(
                spec.env.name, spec.rollout.template, vocab_size=spec.vocab_size, seeds=spec.data.tokenizer_seeds
            ).save_pretrained(local)
    with runfolder.local_copy(tok_dir) as local:
        return load_tokenizer(local)


def _task_sets(spec: WarmStartSpec, env) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """(training goals, held-out goals, the validation panel's (task_id, seed) pairs: seen then held-out)."""
    train_ids, held_ids = tasks.split_holdout(
        tasks.select_tasks(spec.tasks.train, env.num_tasks, env.task_info), [], spec.tasks.holdout_every
    )
    v = spec.val
    seen, held = tasks.validation_panel(
        train_ids[:: v.rl_every], held_ids, v.num_tasks, v.num_holdout_tasks, v.seed, "spread", v.seeds_per_goal
    )
    return train_ids, held_ids, seen + held


class _WarmStart:
    """The state of one warm-start run: data, learner, sampling engines, pool, metrics, update count."""

    def __init__(self, spec: WarmStartSpec, run_dir: epath.Path, tokenizer, examples, progress: bool):
        self.spec, self.run_dir, self.tokenizer, self.progress = spec, run_dir, tokenizer, progress
        self.limit = spec.data.length_buckets[-1]
        self.examples = [e for e in examples if self.fits(e)]
        cfg = tiny_actor_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id, **spec.actor)
        actor = Qwen2Actor(cfg, rngs=nnx.Rngs(spec.seed))
        self.learner = Learner(actor, make_mesh(1, 1, 1, devices=jax.devices()[:1]), make_optimizer(spec))
        self.checkpointer = Checkpointer(os.fspath(run_dir))
        # checkpoint steps count the saves; ``resume``: the position inside ``start_round`` (None: its start)
        self.start_round, self.step, self.next_save, self.resume = 0, 0, 0, None
        restored = self.checkpointer.restore_latest(self.learner.params, self.learner.opt_state)
        if restored is not None:
            latest, (self.learner.params, self.learner.opt_state, _, raw) = restored
            self.learner.sync_local()
            meta = CheckpointMeta.from_dict(raw)
            self.step, self.next_save, self.resume = meta.updates, latest + 1, meta.data_stream
            self.start_round = meta.iteration + (meta.data_stream is None)
        for r in range(min(self.start_round, spec.dagger.rounds)):  # DAgger data of the finished rounds
            self.examples += [e for e in read_dagger_examples(run_dir, r, spec.rollout, tokenizer) if self.fits(e)]
        start = self.step + 1 if restored is not None else 0
        self.metrics = MetricsLogger(os.fspath(run_dir), start_iteration=start)
        self.example_log = _ExampleLog(run_dir / EXAMPLES_FILE, self.step) if spec.train.log_examples else None
        self.temperatures = {"dagger": spec.dagger.temperature, "val": spec.val.temperature, "greedy": 0.0}
        # one engine samples at every temperature (a per-call argument); greedy is a compile-time setting
        self.engines = {greedy: Engine(tokenizer, spec.sampler_at(0.0 if greedy else 1.0)) for greedy in (False, True)}
        self.pool = None

    def fits(self, e: Example) -> bool:
        return len(e.prompt_ids) + len(e.response_ids) <= self.limit

    def play(self, kind: str, pairs, key, label: bool = False) -> RolloutResult:
        """``rollout.collect`` of one game per (task_id, seed) with sampler ``kind`` (oracle labels on request)."""
        learner, pool = self.learner, self.pool
        labeler = pool.oracle_actions if label else None
        temperature = self.temperatures[kind]
        return collect(
            learner.actor,
            self.engines[temperature == 0],
            pool,
            self.tokenizer,
            pairs,
            self.spec.rollout,
            key,
            progress=self.progress,
            labeler=labeler,
            temperature=temperature or None,
        )

    def save(self, rnd: int, key, data_stream: dict[str, Any] | None = None) -> None:
        """Checkpoint the learner after round ``rnd`` (``data_stream`` None) or inside it."""
        meta = CheckpointMeta(iteration=rnd, updates=self.step, seed=self.spec.seed, data_stream=data_stream)
        self.checkpointer.save(self.next_save, self.learner.params, self.learner.opt_state, key, meta)
        self.next_save += 1

    def _stream(self, n_steps: int, rnd: int, rng: np.random.Generator) -> tuple[BucketStream | None, int]:
        """The round's batch stream (its seed drawn from ``rng`` either way) and the updates already done:
        at a resumed round's saved position (``self.resume``), else at its start.

        Raises:
          ValueError: the saved position is over another number of examples (the data changed).
        """
        if not n_steps:
            return None, 0
        t, d = self.spec.train, self.spec.data
        stream = batches(self.examples, t.batch_size, d.length_buckets, rng)
        saved, self.resume = self.resume, None
        if saved is None:
            return stream, 0
        if saved["examples"] != len(self.examples):
            raise ValueError(
                f"round {rnd} was checkpointed over {saved['examples']} examples, this run has {len(self.examples)}: "
                "the demonstrations or config.data changed; resume with the run's config or start a new --workdir"
            )
        stream.set_state(saved["stream"])
        return stream, int(saved["round_updates"])

    def train(self, n_steps: int, rnd: int, rng: np.random.Generator, key, t_start: float) -> None:
        """``n_steps`` updates on epochs of the examples (batches from ``rng``), metrics every ``log_every``,
        a checkpoint (``key``, the stream's position) every ``checkpoint_every`` inside the round."""
        t, d = self.spec.train, self.spec.data
        stream, done = self._stream(n_steps, rnd, rng)
        bar = tqdm(total=n_steps, initial=done, desc=f"round {rnd} train", disable=not self.progress)
        window = []
        self.learner.release_local()  # the steps do not run the actor: its copy's memory goes to them
        while done < n_steps:
            length, exs = next(stream)
            batch = make_batch(exs, length, self.tokenizer.pad_token_id, d.response_length)
            window.append(train_step(self.learner, batch, t.micro_batch_rows, f"SFT update {self.step}"))
            self.step, done = self.step + 1, done + 1
            bar.update(1)
            if self.example_log is not None:
                self.example_log.add(self.step, rnd, [e.key for e in exs])
            if self.step % t.log_every == 0 or done == n_steps:
                rec = {f"train/{k}": float(np.mean([w[k] for w in window])) for k in window[0]}
                bar.set_postfix(loss=f"{rec['train/loss']:.3f}", acc=f"{rec['train/token_accuracy']:.3f}")
                rec.update({"train/examples": len(self.examples), "time_s": time.time() - t_start})
                self.metrics.write(self.step, {"round": rnd, **rec})
                if self.example_log is not None:
                    self.example_log.flush()
                window = []
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and done < n_steps:
                pos = {"round_updates": done, "examples": len(self.examples), "stream": stream.get_state()}
                self.save(rnd, key, pos)
        bar.close()
        self.learner.sync_local()

    def dagger(self, rnd: int, rng: np.random.Generator, key, train_ids: list[int]) -> dict[str, Any]:
        """One DAgger round: the policy plays fresh seeds of training goals, the oracle labels every state."""
        d, t1 = self.spec.dagger, time.time()
        goals = [train_ids[i] for i in rng.integers(0, len(train_ids), d.episodes)]
        pairs = [(t, d.seed_base + rnd * 10_000 + k) for k, t in enumerate(goals)]
        res = self.play("dagger", pairs, key, label=True)
        records = dagger_records(res, rnd, self.spec.env.name)
        demos.write_records(dagger_file(self.run_dir, rnd), records)
        # States far off the expert's path can outgrow the longest bucket: left out, counted.
        fit = [e for e in (record_example(r, self.spec.rollout, self.tokenizer) for r in records) if self.fits(e)]
        self.examples.extend(fit)
        s = summarize(res.episodes)
        return {
            "dagger/success": s["success"],
            "dagger/invalid_rate": s["invalid_rate"],
            "dagger/new_examples": len(fit),
            "dagger/too_long": len(records) - len(fit),
            "dagger_s": time.time() - t1,
        }

    def rounds(self, train_ids, panel, held_set, t_start: float) -> list[dict[str, Any]]:
        """BC (round 0) and the DAgger rounds from ``start_round``, checkpointed after each; their records."""
        spec, history = self.spec, []
        base_key = jax.random.key(spec.seed)
        for rnd in range(self.start_round, spec.dagger.rounds + 1):
            # Every round draws from (seed, round) only, so a resumed run repeats an uninterrupted one.
            rng, key = np.random.default_rng([spec.seed, rnd]), jax.random.fold_in(base_key, rnd)
            t0 = time.time()
            self.train(spec.train.bc_steps if rnd == 0 else spec.train.steps_per_round, rnd, rng, key, t_start)
            rec = {"round": rnd, "train_s": time.time() - t0}
            if rnd < spec.dagger.rounds:
                rec.update(self.dagger(rnd, rng, jax.random.fold_in(key, 0), train_ids))
            if spec.val.every_round and rnd < spec.dagger.rounds:
                s = summarize(self.play("val", panel, jax.random.fold_in(key, 1)).episodes, held_set)
                rec.update({f"val/{k}": v for k, v in s.items()})
            self.metrics.write(self.step, rec)
            history.append(rec)
            if self.progress:
                print(json.dumps(rec), flush=True)
            self.save(rnd, key)
        return history


def check_resume(spec: WarmStartSpec, run_dir: str | epath.Path, allow_change: bool = False) -> None:
    """Refuse to resume the warm start in ``run_dir`` with a config that differs from its ``config.json``
    outside ``resume.SFT_NEUTRAL`` (``resume.check_config_change``; ``allow_change`` keeps the old one as
    ``config.before_<updates>.json``), then write ``spec``'s config there. Reads two small files.

    Raises:
      ConfigChangeError: (a ``ValueError``) naming the folder, its logged updates and the changed fields.
    """
    workdir = os.fspath(run_dir)
    updates = max((r[metric_keys.ITERATION] for r in read_metrics(workdir) if "train/loss" in r), default=0)
    new = spec.config.to_dict()
    old = resume.stored_config(workdir)
    resume.check_config_change(workdir, old, new, updates, allow_change, neutral=resume.SFT_NEUTRAL, unit="updates")
    runfolder.write_text(runfolder.path(workdir) / resume.CONFIG_FILE, spec.config.to_json_best_effort(indent=2))


def run(
    c, workdir: str, out: str | None = None, *, progress: bool = True, allow_config_change: bool = False
) -> dict[str, Any]:
    """Runs the whole warm start; returns the report dict (also written to ``workdir/report.json``).

    ``c``: a warm-start config (``configs/sft_textcraft_tiny.py``) or its ``WarmStartSpec``.
    ``workdir`` and ``out`` may be local folders or ``gs://`` URLs (``bipace_jax.runfolder``). The
    config goes to ``workdir/config.json``; a resume (the same ``workdir`` again) with a config that
    changes the run is refused unless ``allow_config_change`` (``check_resume``).

    Raises:
      ConfigError: (a ``ValueError``) a bad config field (``build_warm_start``).
      RunFolderError: ``workdir`` or ``out`` cannot be created or written (checked before anything loads).
      ConfigChangeError: (a ``ValueError``) ``workdir`` holds a warm start of another config (checked
        before anything loads).
    """
    spec = c if isinstance(c, WarmStartSpec) else build_warm_start(c)
    t_start = time.time()
    run_dir = runfolder.prepare(workdir, "--workdir")
    out_dir = runfolder.prepare(out, "--out") if out else None
    check_resume(spec, run_dir, allow_config_change)
    tokenizer = _tokenizer(spec, run_dir)
    t_tok = time.time() - t_start

    env = environments.make(spec.env.name, max_steps=spec.env.max_steps)
    train_ids, held_ids, panel = _task_sets(spec, env)
    held_set = set(held_ids)
    builder = expert_dataset(spec, os.fspath(run_dir / "demos"), progress)
    examples, ostats = demo_examples(demos.read_split(builder, "train"), spec.rollout, tokenizer)

    ws = _WarmStart(spec, run_dir, tokenizer, examples, progress)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ws.learner.params))
    n_envs, options = max(len(panel), spec.dagger.episodes), {"max_steps": spec.env.max_steps}
    ws.pool = EnvPool(spec.env.name, n_envs, env_options=options, num_workers=spec.env.num_workers or None)
    try:
        history = ws.rounds(train_ids, panel, held_set, t_start)
        key = jax.random.fold_in(jax.random.key(spec.seed), spec.dagger.rounds + 1)
        eps, geps = ws.play("val", panel, key).episodes, ws.play("greedy", panel, key).episodes
    finally:
        ws.pool.close()
        ws.checkpointer.close()
    final, greedy = summarize(eps, held_set), summarize(geps, held_set)
    finals = {**{f"final/{k}": v for k, v in final.items()}, **{f"final_greedy/{k}": v for k, v in greedy.items()}}
    ws.metrics.write(ws.step + 1, finals)
    ws.metrics.close()
    report = {
        "final_val": final,
        "panel_temperature": spec.val.temperature,
        "wall_time_s": time.time() - t_start,
        "final_greedy": greedy,
        "greedy_first_games": summarize(geps[:16], held_set),
        "tokenizer_s": t_tok,
        "num_params": n_params,
        "vocab_size": len(tokenizer),
        "updates": ws.step,
        "expert_examples": sum(e.source == "expert" for e in ws.examples),
        "dagger_examples": sum(e.source == "dagger" for e in ws.examples),
        "oracle": ostats,
        "rounds": history,
        "seed": spec.seed,
        "train_goals": len(train_ids),
        "heldout_goals": held_ids,
        "panel": panel,
        "panel_episodes": [dataclasses.asdict(e) for e in eps],
        "config": spec.config.to_dict(),
    }
    runfolder.write_text(run_dir / "report.json", json.dumps(report, indent=1, default=str))
    if out_dir is not None:
        _export(ws, tokenizer, report, out_dir)
    return report


def _export(ws: _WarmStart, tokenizer, report: dict[str, Any], out_dir: epath.Path) -> None:
    """The Hugging Face folder ``out_dir``: weights, config, tokenizer (also in ``tokenizer/``), the report."""
    with runfolder.staged(out_dir) as local:
        save_hf_checkpoint(ws.learner.actor, local, tokenizer=tokenizer)
        # transformers' AutoTokenizer, seeing config.json's model_type "qwen2", would swap in Qwen's
        # pre-tokenizer: the tokenizer as trained also goes to <out>/tokenizer (no config.json beside it).
        tokenizer.save_pretrained(os.path.join(local, "tokenizer"))
        small = {k: v for k, v in report.items() if k not in ("panel", "panel_episodes")}
        with open(os.path.join(local, "sft_report.json"), "w") as f:
            json.dump(small, f, indent=1, default=str)
