"""The checks of a run config (``configs/base.py`` layout): ``ConfigError``, the field checks, and the
frozen records of the config sections that have no library dataclass of their own.

This module is the bottom of the library's imports: it imports nothing from ``bipace_jax``. The
mapping from a config onto the library's dataclasses (``SamplerConfig``, ``RolloutConfig``,
``EstimatorConfig``, ``PPOLossConfig``, the actor, the learner) is ``bipace_jax.build``.

Every check names its field directly: a bad field raises ``ConfigError`` (a ``ValueError``) whose
message is one line naming the field, the expected value and the value found, e.g.
``config.val.every must be an int >= 0, got -1``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import math
import os
import re
from typing import Any, ClassVar

import jax

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SELECTOR_PART = re.compile(r"^(all|\d+:\d+|\d+(,\d+)*|[A-Za-z_]\w*=[^=&]+)$")
_TEMPLATE_REF = re.compile(r"^[\w.]+:\w+$")


class ConfigError(ValueError):
    """A config field holds a value the trainer cannot use."""


# ------------------------------------------------------------------------------------------------
# Field checks: each takes the field's dotted name (without "config.") and its value.


def fail(field: str, expected: str, got: Any) -> None:
    """Raise ``ConfigError("config.<field> must <expected>, got <got!r>")``."""
    raise ConfigError(f"config.{field} must {expected}, got {got!r}")


def get(c: Any, field: str) -> Any:
    """The value of dotted ``field`` of config ``c``; raises ``ConfigError`` when it is missing."""
    node = c
    for part in field.split("."):
        if part not in node:
            raise ConfigError(f"config.{field} is missing")
        node = node[part]
    return node


def check_int(field: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` when it is an int (not a bool) in [lo, hi] (open ends when None); else ``ConfigError``."""
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" >= {lo}" if hi is None and lo is not None else (f" in [{lo}, {hi}]" if lo is not None else "")
        fail(field, f"be an int{rng}", v)
    return v


def check_float(
    field: str, v: Any, lo: float | None = None, hi: float | None = None, lo_open=False, hi_open=False
) -> float:
    """``float(v)`` when ``v`` is a number (not a bool, not NaN) in the interval; else ``ConfigError``."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        fail(field, f"be a number in {lb}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}{rb}", v)
    return float(v)


def check_choice(field: str, v: Any, choices) -> Any:
    """``v`` when it is one of ``choices``; else ``ConfigError`` listing them."""
    if v not in tuple(choices):
        fail(field, f"be one of {[str(x) if isinstance(x, enum.Enum) else x for x in choices]}", v)
    return v


def check_bool(field: str, v: Any) -> bool:
    """``v`` when it is a bool; else ``ConfigError``."""
    if not isinstance(v, bool):
        fail(field, "be True or False", v)
    return v


def check_str(field: str, v: Any, what: str = "a string") -> str:
    """``v`` when it is a str; else ``ConfigError`` saying ``be <what>``."""
    if not isinstance(v, str):
        fail(field, f"be {what}", v)
    return v


def decode(field: str, enum_type: type[enum.StrEnum], v: Any) -> enum.StrEnum:
    """The member of ``enum_type`` named by string ``v``; else ``ConfigError`` listing the members."""
    try:
        return enum_type(v)
    except ValueError:
        fail(field, f"be one of {[m.value for m in enum_type]}", v)


SelectorPart = tuple  # ("all",) | ("range", a, b) | ("ids", frozenset) | ("key", key, frozenset of values)


def parse_selector(text: str) -> tuple[SelectorPart, ...]:
    """The parts of a task selector (the one parser of its grammar; ``tasks.select_tasks`` evaluates them).

    ``"all"``; ``"a:b"`` (range); ``"i,j,k"``; ``"key=v1,v2"``; parts joined with ``"&"`` intersect;
    ``""`` has no parts (selects nothing).

    Raises:
      ValueError: ``text`` is not a string or a part is none of the four forms.
    """
    if not isinstance(text, str):
        raise ValueError(f"task selector must be a string, got {text!r}")
    if text.strip() == "":
        return ()
    parts = []
    for raw in text.split("&"):
        part = raw.strip()
        if not _SELECTOR_PART.match(part):
            raise ValueError(f"task selector {text!r}: part {part!r} is not 'all', 'a:b', 'i,j,k' or 'key=v1,v2'")
        if part == "all":
            parts.append(("all",))
        elif "=" in part:
            key, values = part.split("=", 1)
            parts.append(("key", key.strip(), frozenset(v.strip() for v in values.split(","))))
        elif ":" in part:
            a, b = (int(x) for x in part.split(":"))
            parts.append(("range", a, b))
        else:
            parts.append(("ids", frozenset(int(x) for x in part.split(","))))
    return tuple(parts)


def validate_selector(field: str, value: str, allow_empty: bool) -> None:
    """Check a task selector string (syntax in ``configs/base.py``, ``parse_selector``); raises ConfigError."""
    if not isinstance(value, str):
        fail(field, "be a task selector string", value)
    if value == "" and not allow_empty:
        fail(field, "be a non-empty task selector ('all', 'a:b', 'i,j', 'key=v1,v2')", value)
    try:
        parse_selector(value)
    except ValueError:
        fail(field, "be a task selector: 'all', 'a:b', 'i,j,k' or 'key=v1,v2', joined by '&'", value)


def parse_game_options(field: str, text: Any) -> dict[str, Any]:
    """The game keyword options of a config string: "" -> {}, else a JSON object.

    Raises:
      ConfigError: naming ``field``, when the text is not a string holding a JSON object.
    """
    if not isinstance(text, str):
        fail(field, "be a string ('' or a JSON object of game options)", text)
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.{field} must be '' or a JSON object of game options, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        fail(field, "be '' or a JSON object of game options", text)
    return value


def resolve_path(path: str) -> str:
    """A config path as given when it exists (absolute, or relative to the working directory), else
    relative to the project root (so ``bipace_jax/data/...`` in a config works from any directory);
    "" stays "". Remote paths (``gs://...``) are returned unchanged."""
    if not path or "://" in path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.join(PROJECT_ROOT, path)
    return candidate if os.path.exists(candidate) else path


def resolve_template(spec: str, field: str = "rollout.template") -> Any:
    """A prompt template from a config string: "" (the game's default, None), a JSON object of
    ``PromptTemplate`` field overrides (a dict), or ``"module:ATTR"`` naming such a mapping.

    Raises:
      ConfigError: naming ``field``: not one of those forms, a reference that does not import, or a
        malformed JSON object.
    """
    check_str(field, spec)
    if not spec:
        return None
    if spec.lstrip().startswith("{"):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.{field} must be valid JSON, got {spec!r} ({e})") from None
    if not _TEMPLATE_REF.match(spec):
        fail(field, "be '', a JSON object of PromptTemplate fields, or 'module:ATTR'", spec)
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config.{field} must name 'module:ATTR', got {spec!r} ({e})") from None


def system_prompt_of(value: str) -> str | None:
    """A config's system prompt -> ``RolloutConfig.system_prompt``: ``"default"`` -> None (the chat
    template's own: Qwen2.5 inserts its default, the project's tiny template none), else the text
    (``""`` = an empty system turn). RL and the warm start both map it here, so their prompts agree."""
    return None if value == "default" else value


#: ``compile_cache_dir = "auto"``'s folder on accelerators: ``$BIPACE_COMPILE_CACHE``, else the user cache
#: dir (``$XDG_CACHE_HOME`` or ``~/.cache``) / ``bipace_jax/xla``. Entries are keyed by program, compiler
#: version and device kind, so runs of several configs and machines can share it.
COMPILE_CACHE_ENV = "BIPACE_COMPILE_CACHE"


def compile_cache_folder(value: str, backend: str) -> str:
    """The persistent compilation cache folder of a ``compile_cache_dir`` value on ``backend`` ("cpu",
    "gpu", "tpu"): "" = off; "auto" = off on CPU (its compiles take seconds), else
    `COMPILE_CACHE_ENV` or ``<user cache dir>/bipace_jax/xla``; any other value is the folder itself."""
    if value != "auto":
        return resolve_path(value) if value else ""
    if backend == "cpu":
        return ""
    if os.environ.get(COMPILE_CACHE_ENV):
        return os.environ[COMPILE_CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "bipace_jax", "xla")


def enable_compile_cache(c: Any) -> str:
    """Point JAX's persistent compilation cache at ``c.compile_cache_dir`` (`compile_cache_folder`:
    "" off, "auto" a user cache dir on accelerators) and return the folder ("" when off). Call it after
    ``jax.distributed.initialize`` (it asks for the default backend). ``c``: a run config or a
    ``RunSpec`` (both have the field)."""
    value = getattr(c, "compile_cache_dir", "")
    folder = compile_cache_folder(value, jax.default_backend() if value == "auto" else "")
    if folder:
        jax.config.update("jax_compilation_cache_dir", folder)
    return folder


# ------------------------------------------------------------------------------------------------
# Closed option sets, decoded once from their config strings.


class OldLogprobs(enum.StrEnum):
    """``ppo.old_logprobs``: where the PPO ratio's old log-probabilities come from."""

    RECOMPUTE = "recompute"  # a forward of the current policy (verl's default)
    SAMPLER = "sampler"  # the sampler's own (exact when the sampler is untruncated)
    FUSED = "fused"  # stop_gradient inside the gradient pass (one optimizer step per iteration)


class WebShopScorer(enum.StrEnum):
    """``env.webshop_scorer``: the revision of WebShop's option rule (``environments.webshop_reward``)."""

    VERL_AGENT = "verl_agent"  # the baseline's (GiGPO/verl-agent vendor it): goal options as (name, value) pairs
    UPSTREAM = "upstream"  # the later upstream rule: goal option values, colour-normalised like the clicked ones


class Schedule(enum.StrEnum):
    """``optim.schedule``: the learning rate over optimizer steps (``learner.make_optimizer``)."""

    CONSTANT = "constant"  # linear warmup over ``warmup_steps``, then ``learning_rate`` (RL: the paper's)
    WARMUP_COSINE = "warmup_cosine"  # linear warmup, then cosine decay to 10% at the last step (the warm start)


class Panel(enum.StrEnum):
    """``val.panel``: how the validation goals are picked (``tasks.validation_panel``)."""

    SPREAD = "spread"
    RANDOM = "random"


# ------------------------------------------------------------------------------------------------
# Sections without a library dataclass. ``SECTION`` is the config section each mirrors one to one;
# ``from_config`` reads it, ``__post_init__`` checks every field under its config name.


def _section_values(cls, c: Any, fields: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The fields of ``cls`` (or only ``fields``) read from config section ``cls.SECTION`` of ``c``."""
    names = fields if fields is not None else tuple(f.name for f in dataclasses.fields(cls))
    return {name: get(c, f"{cls.SECTION}.{name}") for name in names}


class Section:
    """Base of a frozen config-section record: ``SECTION`` names the config section it mirrors."""

    SECTION: ClassVar[str] = ""

    @classmethod
    def from_config(cls, c: Any, fields: tuple[str, ...] | None = None):
        """The section ``cls.SECTION`` of config ``c``; with ``fields``, only those are read (a config
        that has no use for the others, e.g. the warm start's, leaves them at their defaults).

        Raises:
          ConfigError: naming a missing or bad field.
        """
        return cls(**_section_values(cls, c, fields))

    def _name(self, field: str) -> str:
        return f"{self.SECTION}.{field}"


@dataclasses.dataclass(frozen=True)
class EnvConfig(Section):
    """``config.env``: the game, its step cap, pool workers and timeout, and its options (a dict)."""

    SECTION: ClassVar[str] = "env"
    name: str = "textcraft"
    max_steps: int = 50
    num_workers: int = 0
    timeout_s: float = 30.0
    options: Any = ""
    webshop_scorer: Any = WebShopScorer.VERL_AGENT

    def __post_init__(self):
        check_str(self._name("name"), self.name, "a registered game name")
        check_int(self._name("max_steps"), self.max_steps, 1)
        check_int(self._name("num_workers"), self.num_workers, 0)
        check_float(self._name("timeout_s"), self.timeout_s, 0, lo_open=True)
        if not isinstance(self.options, dict):
            object.__setattr__(self, "options", parse_game_options(self._name("options"), self.options))
        scorer = decode(self._name("webshop_scorer"), WebShopScorer, self.webshop_scorer)
        object.__setattr__(self, "webshop_scorer", scorer)
        native = self.name == "webshop" and self.options.get("engine", "native") == "native"
        if scorer is not WebShopScorer.VERL_AGENT and not native:
            fail(
                self._name("webshop_scorer"),
                f"be {WebShopScorer.VERL_AGENT.value!r} unless env.name is 'webshop' (native engine)",
                scorer.value,
            )
        if native and "scorer" in self.options and self.options["scorer"] != scorer.value:
            fail(
                self._name("options"),
                f"leave 'scorer' to config.env.webshop_scorer ({scorer.value!r})",
                self.options["scorer"],
            )
        if native:  # the game takes it as its option: every pool and probe of the run gets it
            object.__setattr__(self, "options", {**self.options, "scorer": scorer.value})


@dataclasses.dataclass(frozen=True)
class TasksConfig(Section):
    """``config.tasks``: task selectors of the training and held-out goals (``tasks.select_tasks``)."""

    SECTION: ClassVar[str] = "tasks"
    train: str = "all"
    holdout: str = ""
    holdout_every: int = 0

    def __post_init__(self):
        validate_selector(self._name("train"), self.train, allow_empty=False)
        validate_selector(self._name("holdout"), self.holdout, allow_empty=True)
        check_int(self._name("holdout_every"), self.holdout_every, 0)


@dataclasses.dataclass(frozen=True)
class ValConfig(Section):
    """``config.val``: the validation schedule and panels (``tasks.validation_panel``); ``options`` and
    ``holdout_options`` as dicts (game options on top of ``env.options``; {} = the training game)."""

    SECTION: ClassVar[str] = "val"
    every: int = 10
    at_start: bool = True
    num_tasks: int = 64
    num_holdout_tasks: int = 64
    panel: Panel = Panel.SPREAD
    seeds_per_goal: int = 1
    group_size: int = 1
    temperature: float = 0.4
    options: Any = ""
    holdout_options: Any = ""
    seed: int = 1_000_000

    def __post_init__(self):
        check_int(self._name("every"), self.every, 0)
        check_bool(self._name("at_start"), self.at_start)
        check_int(self._name("num_tasks"), self.num_tasks, 0)
        check_int(self._name("num_holdout_tasks"), self.num_holdout_tasks, 0)
        check_int(self._name("group_size"), self.group_size, 1)
        check_int(self._name("seeds_per_goal"), self.seeds_per_goal, 1)
        check_float(self._name("temperature"), self.temperature, 0, lo_open=True)
        check_int(self._name("seed"), self.seed, 1_000_000)  # >= tasks.TRAIN_SEED_RANGE: never a training game
        object.__setattr__(self, "panel", decode(self._name("panel"), Panel, self.panel))
        for f in ("options", "holdout_options"):
            if not isinstance(getattr(self, f), dict):
                object.__setattr__(self, f, parse_game_options(self._name(f), getattr(self, f)))

    @property
    def validating(self) -> bool:
        """Whether the run validates at all (on a schedule or before the first iteration)."""
        return bool(self.every or self.at_start)


@dataclasses.dataclass(frozen=True)
class CalibrationConfig(Section):
    """``config.estimator.calibration``: the one-shot epsilon sweep on the first batch (``calibrate_epsilon``)."""

    SECTION: ClassVar[str] = "estimator.calibration"
    enabled: bool = False
    target_singleton_rate: float = 0.25
    grid: tuple[float, ...] = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1)

    def __post_init__(self):
        check_bool(self._name("enabled"), self.enabled)
        object.__setattr__(self, "grid", tuple(self.grid))
        if not self.enabled:
            return
        check_float(self._name("target_singleton_rate"), self.target_singleton_rate, 0, 1)
        g = self.grid
        if (
            not g
            or any(isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < 1 for e in g)
            or any(b <= a for a, b in zip(g, g[1:]))
        ):
            fail(self._name("grid"), "be a non-empty, strictly ascending tuple of values in [0, 1)", g)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """The batching of ``config.ppo`` (its loss coefficients are ``losses.PPOLossConfig``).

    Attributes:
      epochs: passes over the iteration's rows (>= 1).
      mini_batch_rows: rows per optimizer update, a multiple of ``micro_batch_rows``; 0 = all rows.
      micro_batch_rows: rows per forward/backward (>= 1; gradient accumulation).
      logprob_chunk: response positions per LM-head chunk (>= 0; 0 = all at once).
      old_logprobs: an ``OldLogprobs``; ``FUSED`` needs one optimizer step (epochs 1, mini_batch_rows 0).
      pack: packed, token-budget micro-batches in the log-prob pass and the update (``PPOLearner``):
        ``micro_batch_rows`` lines of ``pack_width`` tokens, each holding as many rows' real tokens as
        fit, instead of ``micro_batch_rows`` padded rows; same values and optimizer steps.
      pack_width: tokens per packed line (>= 0; 0 = the batch's row width, widest prompt + response).
      pack_response_width: response tokens per packed line, the LM head's positions (>= 0; 0 =
        min(pack width, 2 x the response width)).
    """

    SECTION: ClassVar[str] = "ppo"
    epochs: int = 1
    mini_batch_rows: int = 0
    micro_batch_rows: int = 8
    logprob_chunk: int = 0
    old_logprobs: OldLogprobs = OldLogprobs.RECOMPUTE
    pack: bool = False
    pack_width: int = 0
    pack_response_width: int = 0

    @classmethod
    def from_config(cls, c: Any) -> LearnerConfig:
        """``LearnerConfig`` of ``c.ppo``; raises ``ConfigError`` naming a bad field."""
        return cls(**_section_values(cls, c))

    def __post_init__(self):
        check_int("ppo.epochs", self.epochs, 1)
        check_int("ppo.mini_batch_rows", self.mini_batch_rows, 0)
        check_int("ppo.micro_batch_rows", self.micro_batch_rows, 1)
        check_int("ppo.logprob_chunk", self.logprob_chunk, 0)
        check_bool("ppo.pack", self.pack)
        check_int("ppo.pack_width", self.pack_width, 0)
        check_int("ppo.pack_response_width", self.pack_response_width, 0)
        if self.mini_batch_rows % self.micro_batch_rows:
            fail(
                "ppo.mini_batch_rows",
                f"be a multiple of ppo.micro_batch_rows={self.micro_batch_rows} (or 0)",
                self.mini_batch_rows,
            )
        mode = decode("ppo.old_logprobs", OldLogprobs, self.old_logprobs)
        object.__setattr__(self, "old_logprobs", mode)
        self.check_old_logprobs(mode, self.epochs, self.mini_batch_rows)

    @staticmethod
    def check_old_logprobs(mode: OldLogprobs, epochs: int, mini_batch_rows: int) -> None:
        """The one rule of ``ppo.old_logprobs`` (also asked by ``PPOLearner``): ``FUSED`` needs one
        optimizer step per iteration. Raises ``ConfigError`` naming ``config.ppo.old_logprobs``."""
        if mode is OldLogprobs.FUSED and (epochs != 1 or mini_batch_rows != 0):
            fail(
                "ppo.old_logprobs",
                "not be 'fused' unless ppo.epochs == 1 and ppo.mini_batch_rows == 0 (one optimizer step per iteration)",
                str(mode),
            )

    @staticmethod
    def check_tis_cap(mode: OldLogprobs, tis_cap: float) -> None:
        """Truncated importance weights (``ppo.tis_cap`` > 0) compare the learner's old log-probs with
        the sampler's, so they need ``ppo.old_logprobs == 'recompute'``: with ``'sampler'`` or
        ``'fused'`` the old log-probs are the sampler's own (every weight 1). Raises ``ConfigError``
        naming both fields (asked by ``build.build_spec`` and ``PPOLearner``)."""
        if tis_cap > 0 and mode is not OldLogprobs.RECOMPUTE:
            fail(
                "ppo.tis_cap",
                f"be 0 unless ppo.old_logprobs == 'recompute' (with '{mode}' the old log-probs are the sampler's)",
                tis_cap,
            )


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """``config.optim``: AdamW after global-norm clipping; the learning rate rises linearly over
    ``warmup_steps`` to ``learning_rate``, then follows ``schedule`` (a ``Schedule``)."""

    SECTION: ClassVar[str] = "optim"
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: Schedule = Schedule.CONSTANT
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        check_float(self._name("learning_rate"), self.learning_rate, 0, lo_open=True)
        check_int(self._name("warmup_steps"), self.warmup_steps, 0)
        object.__setattr__(self, "schedule", decode(self._name("schedule"), Schedule, self.schedule))
        check_float(self._name("weight_decay"), self.weight_decay, 0)
        check_float(self._name("b1"), self.b1, 0, 1, hi_open=True)
        check_float(self._name("b2"), self.b2, 0, 1, hi_open=True)
        check_float(self._name("eps"), self.eps, 0, lo_open=True)
        check_float(self._name("grad_clip"), self.grad_clip, 0, lo_open=True)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """``config.checkpoint``: save every ``every`` iterations (and at the end), keep ``keep``, export HF;
    ``shared_workdir``: a local ``--workdir`` of a multi-host run is a file system every host sees
    (`plan.check_workdir`); ``async_save``: orbax writes in the background (`Checkpointer`)."""

    SECTION: ClassVar[str] = "checkpoint"
    every: int = 1
    keep: int = 2
    export_hf: bool = True
    shared_workdir: bool = False
    async_save: bool = False

    def __post_init__(self):
        check_int(self._name("every"), self.every, 1)
        check_int(self._name("keep"), self.keep, 1)
        check_bool(self._name("export_hf"), self.export_hf)
        check_bool(self._name("shared_workdir"), self.shared_workdir)
        check_bool(self._name("async_save"), self.async_save)


@dataclasses.dataclass(frozen=True)
class LogConfig(Section):
    """``config.log``: tqdm progress bars; PNG plots at the end; optional wandb tracking; episode transcripts.

    ``wandb``: also log every record to wandb (project ``wandb_project``; the ``wandb`` extra;
    ``WANDB_MODE=offline`` needs no network). Raises ConfigError when it is True and wandb is not
    importable. ``transcripts_every``: write ``episodes/<i>.jsonl`` (``bipace_jax.transcripts``) for
    the training rollouts of every iteration ``i`` divisible by it and for every validation (0 = off);
    ``transcripts_max_games``: the most games each of those phases writes per iteration (>= 1).
    """

    SECTION: ClassVar[str] = "log"
    progress: bool = True
    plots: bool = True
    wandb: bool = False
    wandb_project: str = "bipace_jax"
    transcripts_every: int = 0
    transcripts_max_games: int = 8

    def __post_init__(self):
        check_bool(self._name("progress"), self.progress)
        check_bool(self._name("plots"), self.plots)
        check_int(self._name("transcripts_every"), self.transcripts_every, 0)
        check_int(self._name("transcripts_max_games"), self.transcripts_max_games, 1)
        check_bool(self._name("wandb"), self.wandb)
        if not check_str(self._name("wandb_project"), self.wandb_project):
            fail(self._name("wandb_project"), "be a non-empty wandb project name", self.wandb_project)
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"config.{self._name('wandb')}=True needs wandb: pip install -e '.[wandb]' (or set it False)"
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """``config.mesh``: the training mesh's (data, fsdp, tensor) axis sizes, each >= 1 or -1 (at most
    one: the devices left over), and ``sampler_tensor``, the tensor-parallel size of the mesh each
    host samples and computes log-probs on (its own chips; 0: the same as ``tensor``).

    A separate ``sampler_tensor`` lets the gradient step run pure FSDP (``tensor=1``: every
    all-gather spans the whole slice) while decoding stays tensor-parallel inside a host, whose
    bandwidth-bound decode would otherwise all-gather every weight on every token (v5e's 7B setting:
    ``docs/performance.md``).
    """

    SECTION: ClassVar[str] = "mesh"
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sampler_tensor: int = 0

    def __post_init__(self):
        for f in ("data", "fsdp", "tensor"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or v >= 1):
                fail(self._name(f), "be an int >= 1 or -1 (the devices left over)", v)
        if self.sizes.count(-1) > 1:
            fail("mesh", "have at most one axis set to -1", self._shown())
        check_int(self._name("sampler_tensor"), self.sampler_tensor, 0)

    @property
    def sizes(self) -> list[int]:
        return [self.data, self.fsdp, self.tensor]

    def _shown(self) -> dict[str, int]:
        return dict(data=self.data, fsdp=self.fsdp, tensor=self.tensor)

    def check_devices(self, num_devices: int) -> None:
        """Raises ``ConfigError`` when the mesh does not fit ``num_devices`` exactly."""
        fixed = math.prod(s for s in self.sizes if s != -1)
        if (-1 in self.sizes and num_devices % fixed) or (-1 not in self.sizes and fixed != num_devices):
            fail("mesh", f"fit the {num_devices} devices (data*fsdp*tensor)", self._shown())

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) with the -1 axis resolved for ``num_devices``."""
        fixed = math.prod(s for s in self.sizes if s != -1)
        return tuple(num_devices // fixed if s == -1 else s for s in self.sizes)


class Switch(enum.StrEnum):
    """``async_rl.switch``: where the sampler adopts the learner's newest parameters inside a rollout."""

    TURN = "turn"  # at every turn boundary (partial rollouts: a game's turns may mix versions)
    GAME = "game"  # only when a game starts (each game one version)


@dataclasses.dataclass(frozen=True)
class AsyncConfig(Section):
    """``config.async_rl``: asynchronous RL with a staleness bound (``bipace_jax.async_rl``).

    Attributes:
      max_staleness: k, how many iterations the sampler may play ahead of the learner (int >= 0);
        0 is on-policy (every iteration samples with the parameters of all earlier updates).
      switch: ``Switch``; "turn" needs ``rollout.scheduler="lockstep"`` (the continuous scheduler's
        decode slots bind one set of weights per rollout).
      sampler_devices: 0 = colocated (sampler and learner share every device, the synchronous loop);
        n > 0 = the first n of the process's devices form the sampler group and the rest the learner
        group (one process).
      sampler_processes: 0 = no process role (the above); s > 0 = the last s of the ``jax.distributed``
        processes sample and the others learn (``bipace_jax.async_processes``); exclusive with
        ``sampler_devices``. Supported: 1 sampler and 1 learner process (``check_processes``).
    """

    SECTION: ClassVar[str] = "async_rl"
    max_staleness: int = 0
    switch: Any = Switch.TURN
    sampler_devices: int = 0
    sampler_processes: int = 0

    def __post_init__(self):
        check_int(self._name("max_staleness"), self.max_staleness, 0)
        object.__setattr__(self, "switch", decode(self._name("switch"), Switch, self.switch))
        check_int(self._name("sampler_devices"), self.sampler_devices, 0)
        check_int(self._name("sampler_processes"), self.sampler_processes, 0)
        if self.max_staleness and not self.disaggregated:
            fail(
                self._name("sampler_devices"),
                f"be > 0 with async_rl.max_staleness={self.max_staleness} (or async_rl.sampler_processes > 0: "
                "the sampler needs devices of its own to play ahead of the learner)",
                self.sampler_devices,
            )
        if self.sampler_devices and self.sampler_processes:
            fail(
                self._name("sampler_processes"),
                f"be 0 with async_rl.sampler_devices={self.sampler_devices} (roles split one process's devices "
                "or the processes, not both)",
                self.sampler_processes,
            )

    @property
    def disaggregated(self) -> bool:
        """Whether the sampler and the learner have device groups of their own (in one process or by process)."""
        return self.sampler_devices > 0 or self.sampler_processes > 0

    @property
    def by_process(self) -> bool:
        """Whether the sampler and the learner are processes of their own (``sampler_processes > 0``)."""
        return self.sampler_processes > 0

    def check_processes(self, num_processes: int) -> None:
        """Raises ``ConfigError`` when the process roles do not fit a run of ``num_processes``
        ``jax.distributed`` processes: ``sampler_processes`` must leave the learner a process, and
        (supported today) one process samples and one learns, so the learner's collectives never
        span processes."""
        s = self.sampler_processes
        if not s:
            return
        if num_processes == 1:
            fail(
                self._name("sampler_processes"),
                "be 0 in a run of 1 process (a sampler process needs a learner process beside it: launch.train "
                '--coordinator_address --num_processes=2 --process_id=0 and 1, launch/README.md "by process")',
                s,
            )
        if s != 1 or num_processes != 2:
            fail(
                self._name("sampler_processes"),
                f"be 1 in a run of 2 processes (one samples, one learns; {s} sampler processes in a run of "
                f"{num_processes} are not supported)",
                s,
            )

    @classmethod
    def of(cls, c: Any) -> AsyncConfig:
        """The section of run config ``c``; a config without one (stored before it existed) is colocated."""
        return cls.from_config(c) if "async_rl" in c else cls()

    def check_devices(self, num_devices: int, num_processes: int) -> None:
        """Raises ``ConfigError`` when the roles do not fit ``num_devices`` devices of ``num_processes``
        processes (a disaggregated run splits one process's devices)."""
        if not self.sampler_devices:
            return
        if num_processes > 1:
            fail(
                self._name("sampler_devices"),
                f"be 0 with {num_processes} processes (the roles split one host's devices; by process: "
                "async_rl.sampler_processes)",
                self.sampler_devices,
            )
        if self.sampler_devices >= num_devices:
            fail(
                self._name("sampler_devices"),
                f"leave the learner at least one of the {num_devices} devices (1..{num_devices - 1})",
                self.sampler_devices,
            )


def mesh_shape(c: Any, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes of ``c.mesh`` with the -1 axis resolved; ``c``: a run config or a
    ``RunSpec``."""
    m = c.mesh
    return MeshConfig(m.data, m.fsdp, m.tensor).shape(num_devices)


def check_tensor_in_host(tensor: int, num_processes: int, local_devices: int, field: str = "mesh.tensor") -> None:
    """With several processes the mesh's tensor axis (its resolved size ``tensor``) must lie inside one
    host: its all-reduces then stay on the host's fast links, each host holds whole tensor groups (so
    its batch shards are its own, `sharding.check_placement`), and its sampler and reference copies
    hold whole tensor-parallel shards. ``local_devices`` is the chips (devices) of one host.

    Raises:
      ConfigError: ``num_processes > 1`` and ``tensor`` does not divide ``local_devices`` (so also
        when it is larger): ``config.<field>`` (default ``mesh.tensor``), naming the chips per host and
        the sizes that fit.
    """
    if num_processes <= 1:
        return
    if local_devices % tensor:  # also every tensor > local_devices
        divisors = [d for d in range(1, local_devices + 1) if local_devices % d == 0]
        fail(
            field,
            f"divide the {local_devices} devices of each host, its chips ({num_processes} hosts; a tensor "
            f"group never crosses hosts, so at most {local_devices}): one of {divisors}",
            tensor,
        )
