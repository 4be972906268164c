"""The warm start's spec (``WarmStartSpec``, ``build_warm_start``): its config sections carry RL's names
and records (``build.ModelConfig``, ``config.OptimConfig``, ...) where they mean the same; ``data``,
``train``, ``dagger`` and the panel's ``val`` fields are its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import ml_collections

import environments
from bipace_jax.build import ModelConfig, checked
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
from bipace_jax.rollout import RolloutConfig
from bipace_jax.sampling import SamplerConfig

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
      model: RL's ``build.ModelConfig`` of the fields the warm start reads (``MODEL_FIELDS``: the tiny
        preset's sizes, ``tokenizer`` ("" = build the project's BPE) and ``vocab_size``, its learned
        entries); the actor is ``build.actor_architecture`` of it with the tokenizer's vocabulary.
      env, tasks, sampler, optim: as RL's sections (``config.EnvConfig``, ``config.TasksConfig``,
        ``SamplerConfig`` at temperature 1, ``config.OptimConfig``: ``learner.make_optimizer`` over
        ``total_updates``).
      rollout: how every game is played (one per task group; the RL default's prompt settings).
      data, train, dagger, val: the warm start's own sections.
      config: the checked source config (a ``FrozenConfigDict``; written to ``report.json``).
    """

    seed: int
    model: ModelConfig
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


# The config.model fields a warm start reads (the others keep ModelConfig's defaults: a random tiny init, fp32).
MODEL_FIELDS = (
    "tokenizer",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
)
# max_position_embeddings of the exported config.json (the shipped bipace_jax/data/textcraft_tiny's; RoPE has no table)
MAX_POSITIONS = 2048


def build_warm_start(c) -> WarmStartSpec:
    """Check every field of a warm-start config (``configs/sft_textcraft_tiny.py``) and decode it.

    Raises:
      ConfigError: (a ``ValueError``) naming the first bad field, before anything loads or compiles.
    """
    seed = check_int("seed", get(c, "seed"), 0)
    model = ModelConfig.from_config(c, fields=MODEL_FIELDS)
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
        model=model,
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


def rollout_config(c) -> RolloutConfig:
    """How the warm start plays (one game per panel task, the RL loop's prompt settings)."""
    return build_warm_start(c).rollout
