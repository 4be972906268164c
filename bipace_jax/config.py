"""A run config (``configs/base.py`` layout) -> the library's dataclasses, and its checks.

Each config section maps onto the dataclass it configures, in one builder here:
``sampler`` -> ``SamplerConfig``, ``rollout`` -> ``RolloutConfig``, ``ppo`` -> ``PPOLossConfig`` (and
the learner's batching), ``estimator`` -> ``EstimatorConfig``, ``optim`` -> an optax transformation.
A field a dataclass checks is checked there only: ``validate`` builds the dataclasses and reports
their errors under the config's own field name. ``validate`` adds the checks that span sections or
have no dataclass (paths, task selectors, mesh). Every check runs on the host before anything compiles.

A bad field raises ``ConfigError`` (a ``ValueError``) whose message is one line naming the field,
the expected value and the value found, e.g.
``config.estimator.epsilon: expected a value in [0, 1), got 1.5``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

import environments
from bipace_jax import losses
from bipace_jax.estimators import EpsilonController, EstimatorConfig
from bipace_jax.models import Qwen2Actor, Qwen2Config, load_hf_checkpoint
from bipace_jax.models.qwen2 import MATMUL_PRECISIONS, REMAT_POLICIES
from bipace_jax.ppo import PPOLearner
from bipace_jax.rollout import RolloutConfig
from bipace_jax.sampling import SamplerConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_SELECTOR_PART = re.compile(r"^(all|\d+:\d+|\d+(,\d+)*|[A-Za-z_]\w*=[^=&]+)$")


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_path(path: str) -> str:
    """A config path as given when it exists (absolute, or relative to the working directory), else
    relative to the project root (so ``bipace_jax/data/...`` in a config works from any directory);
    "" stays "". Remote paths (``gs://...``) are returned unchanged."""
    if not path or "://" in path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.join(PROJECT_ROOT, path)
    return candidate if os.path.exists(candidate) else path


class ConfigError(ValueError):
    """A config field holds a value the trainer cannot use."""


def _fail(field: str, expected: str, got) -> None:
    raise ConfigError(f"config.{field} must {expected}, got {got!r}")


def _int(c, field, lo=None, hi=None):
    v = _get(c, field)
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" >= {lo}" if hi is None and lo is not None else (f" in [{lo}, {hi}]" if lo is not None else "")
        _fail(field, f"be an int{rng}", v)


def _float(c, field, lo=None, hi=None, lo_open=False, hi_open=False):
    v = _get(c, field)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        _fail(field, f"be a number in {lb}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}{rb}", v)


def _choice(c, field, choices):
    v = _get(c, field)
    if v not in choices:
        _fail(field, f"be one of {list(choices)}", v)


def _get(c, field):
    node = c
    for part in field.split("."):
        if part not in node:
            raise ConfigError(f"config.{field} is missing")
        node = node[part]
    return node


def validate_selector(field: str, value: str, allow_empty: bool) -> None:
    """Check a task selector string (syntax in ``configs/base.py``); raises ConfigError."""
    if not isinstance(value, str):
        _fail(field, "be a task selector string", value)
    if value == "":
        if not allow_empty:
            _fail(field, "be a non-empty task selector ('all', 'a:b', 'i,j', 'key=v1,v2')", value)
        return
    for part in value.split("&"):
        if not _SELECTOR_PART.match(part.strip()):
            _fail(field, "be a task selector: 'all', 'a:b', 'i,j,k' or 'key=v1,v2', joined by '&'", value)


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, *, abstract: bool = False) -> None:
    """Check every field of a run config; raises ``ConfigError`` naming the first bad field.

    Args:
      c: the config (``configs/base.py`` layout).
      num_devices: when given, the mesh must fit this many devices exactly.
      abstract: the config is only compiled from shapes (``launch.aot``): no checkpoint is needed.
    """
    _int(c, "seed", 0)
    _int(c, "num_iterations", 0)
    if not isinstance(_get(c, "compile_cache_dir"), str):
        _fail(
            "compile_cache_dir", "be a folder path string ('' = no persistent compilation cache)", c.compile_cache_dir
        )
    # model
    ckpt = _get(c, "model.checkpoint")
    if not isinstance(ckpt, str):
        _fail("model.checkpoint", "be a path string ('' = random init)", ckpt)
    try:
        Qwen2Config.preset(_get(c, "model.preset"))
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"config.model.preset must name a Qwen2Config preset ({e})") from None
    if ckpt and not abstract:
        if not os.path.isfile(os.path.join(resolve_path(ckpt), "config.json")):
            _fail(
                "model.checkpoint",
                "be a Hugging Face folder holding config.json (a warm start from launch/sft.py; "
                "--config.model.checkpoint= for a random tiny init)",
                ckpt,
            )
    elif _get(c, "model.preset") != "tiny" and not abstract:
        _fail(
            "model.checkpoint",
            f"point at a Hugging Face {c.model.preset} folder (a {c.model.preset} random init trains nothing useful)",
            ckpt,
        )
    tok = _get(c, "model.tokenizer")
    if not isinstance(tok, str):
        _fail("model.tokenizer", "be a path string ('' = the checkpoint's)", tok)
    if tok and not os.path.isdir(resolve_path(tok)):
        _fail("model.tokenizer", "be an existing tokenizer folder", tok)
    for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        _int(c, f"model.{f}", 1)
    _int(c, "model.vocab_size", 300)
    if c.model.num_heads % c.model.num_kv_heads:
        _fail("model.num_heads", f"be a multiple of model.num_kv_heads={c.model.num_kv_heads}", c.model.num_heads)
    if c.model.hidden_size % c.model.num_heads:
        _fail("model.hidden_size", f"be a multiple of model.num_heads={c.model.num_heads}", c.model.hidden_size)
    _int(c, "model.fingerprint_layer")
    _choice(c, "model.dtype", tuple(_DTYPES))
    _choice(c, "model.param_dtype", tuple(_DTYPES))
    _choice(c, "model.matmul_precision", MATMUL_PRECISIONS)
    _choice(c, "model.remat", REMAT_POLICIES)
    _choice(c, "model.scan_layers", (True, False))
    # env and tasks
    _choice(c, "env.name", environments.registered())
    _int(c, "env.max_steps", 1)
    _int(c, "env.num_workers", 0)
    for field in GAME_OPTION_FIELDS:
        game_options(c, field)
    _float(c, "env.timeout_s", 0, lo_open=True)
    validate_selector("tasks.train", c.tasks.train, allow_empty=False)
    validate_selector("tasks.holdout", c.tasks.holdout, allow_empty=True)
    _int(c, "tasks.holdout_every", 0)
    # rollout / sampler
    _int(c, "rollout.num_groups", 1)
    for f in ("system_prompt", "template", "fallback_action"):
        if not isinstance(_get(c, f"rollout.{f}"), str):
            _fail(f"rollout.{f}", "be a string", _get(c, f"rollout.{f}"))
    tpl = c.rollout.template
    if tpl and not (tpl.lstrip().startswith("{") or re.match(r"^[\w.]+:\w+$", tpl)):
        _fail("rollout.template", "be '', a JSON object of PromptTemplate fields, or 'module:ATTR'", tpl)
    _checked("sampler", lambda: sampler_config(c))
    _checked("rollout", lambda: rollout_config(c, group_size=c.rollout.group_size))
    if c.sampler.length_buckets[-1] < c.rollout.max_prompt_length:
        _fail(
            "sampler.length_buckets",
            f"reach rollout.max_prompt_length={c.rollout.max_prompt_length}",
            tuple(c.sampler.length_buckets),
        )
    # estimator
    _checked("estimator", lambda: estimator_config(c))
    if c.estimator.calibration.enabled:
        _float(c, "estimator.calibration.target_singleton_rate", 0, 1)
        grid = tuple(c.estimator.calibration.grid)
        if (
            not grid
            or any(not isinstance(e, (int, float)) or not 0 <= e < 1 for e in grid)
            or any(b <= a for a, b in zip(grid, grid[1:]))
        ):
            _fail("estimator.calibration.grid", "be a non-empty, strictly ascending tuple of values in [0, 1)", grid)
    if c.estimator.controller.enabled:
        _checked("estimator.controller", lambda: epsilon_controller(c))
    # ppo / optim
    _checked("ppo", lambda: loss_config(c))
    _int(c, "ppo.epochs", 1)
    _int(c, "ppo.mini_batch_rows", 0)
    _int(c, "ppo.micro_batch_rows", 1)
    _int(c, "ppo.logprob_chunk", 0)
    if c.ppo.mini_batch_rows and c.ppo.mini_batch_rows % c.ppo.micro_batch_rows:
        _fail(
            "ppo.mini_batch_rows",
            f"be a multiple of ppo.micro_batch_rows={c.ppo.micro_batch_rows} (or 0)",
            c.ppo.mini_batch_rows,
        )
    _choice(c, "ppo.old_logprobs", ("recompute", "sampler", "fused"))
    if c.ppo.old_logprobs == "fused" and (c.ppo.epochs != 1 or c.ppo.mini_batch_rows != 0):
        _fail(
            "ppo.old_logprobs",
            "not be 'fused' unless ppo.epochs == 1 and ppo.mini_batch_rows == 0 (one optimizer step per iteration)",
            c.ppo.old_logprobs,
        )
    if c.ppo.old_logprobs == "sampler" and (c.sampler.top_p != 1.0 or c.sampler.top_k):
        # The sampler's log-probs are log_softmax(logits / T) before truncation: the policy PPO trains
        # at the rollout temperature T, but not the top-p/top-k-truncated one that played.
        _fail(
            "ppo.old_logprobs",
            "be 'recompute' unless the sampler is untruncated (top_p 1, top_k 0)",
            c.ppo.old_logprobs,
        )
    _float(c, "optim.learning_rate", 0, lo_open=True)
    _int(c, "optim.warmup_steps", 0)
    _float(c, "optim.weight_decay", 0)
    _float(c, "optim.b1", 0, 1, hi_open=True)
    _float(c, "optim.b2", 0, 1, hi_open=True)
    _float(c, "optim.eps", 0, lo_open=True)
    _float(c, "optim.grad_clip", 0, lo_open=True)
    # validation / bookkeeping
    _int(c, "val.every", 0)
    _int(c, "val.num_tasks", 0)
    _int(c, "val.num_holdout_tasks", 0)
    _int(c, "val.group_size", 1)
    _int(c, "val.seeds_per_goal", 1)
    _float(c, "val.temperature", 0, lo_open=True)
    _int(c, "val.seed", 1_000_000)
    _choice(c, "val.panel", ("spread", "random"))
    _int(c, "checkpoint.every", 1)
    _int(c, "checkpoint.keep", 1)
    # mesh
    for f in ("data", "fsdp", "tensor"):
        v = _get(c, f"mesh.{f}")
        if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or v >= 1):
            _fail(f"mesh.{f}", "be an int >= 1 or -1 (the devices left over)", v)
    sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.tensor]
    shown = dict(data=sizes[0], fsdp=sizes[1], tensor=sizes[2])
    if sizes.count(-1) > 1:
        _fail("mesh", "have at most one axis set to -1", shown)
    if num_devices is not None:
        fixed = math.prod(s for s in sizes if s != -1)
        if (-1 in sizes and num_devices % fixed) or (-1 not in sizes and fixed != num_devices):
            _fail("mesh", f"fit the {num_devices} devices (data*fsdp*tensor)", shown)


def mesh_shape(c: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes with the -1 axis resolved; call ``validate`` first."""
    sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    return tuple(num_devices // fixed if s == -1 else s for s in sizes)


def check_tensor_in_host(tensor: int, num_processes: int, local_devices: int) -> None:
    """With several processes the mesh's tensor axis (its resolved size ``tensor``) must lie inside one
    host: its all-reduces then stay on the host's fast links, and each host's sampler and reference
    copies hold whole tensor-parallel shards.

    Raises:
      ConfigError: ``num_processes > 1`` and ``tensor`` does not divide ``local_devices``.
    """
    if num_processes > 1 and local_devices % tensor:
        divisors = [d for d in range(1, local_devices + 1) if local_devices % d == 0]
        _fail(
            "mesh.tensor",
            f"divide the {local_devices} devices of each host ({num_processes} processes): one of {divisors}",
            tensor,
        )


def process_layout(c: ml_collections.ConfigDict, num_processes: int, devices: int, local_devices: int):
    """The mesh's resolved (data, fsdp, tensor) for ``devices`` over ``num_processes`` hosts, after the
    checks that need the process count: task groups and micro-batch rows split evenly over hosts and
    the batch axes, the tensor axis inside a host (`check_tensor_in_host`).

    Raises:
      ConfigError: naming the field whose value does not split.
    """
    if c.rollout.num_groups % num_processes:
        _fail("rollout.num_groups", f"be a multiple of the process count {num_processes}", c.rollout.num_groups)
    data, fsdp, tensor = mesh_shape(c, devices)
    check_tensor_in_host(tensor, num_processes, local_devices)
    if (c.ppo.micro_batch_rows * num_processes) % (data * fsdp):
        _fail(
            "ppo.micro_batch_rows",
            f"be such that it times the {num_processes} processes is a multiple of mesh data*fsdp={data * fsdp}",
            c.ppo.micro_batch_rows,
        )
    return data, fsdp, tensor


def enable_compile_cache(c: ml_collections.ConfigDict) -> None:
    """Point JAX's persistent compilation cache at ``c.compile_cache_dir`` (nothing when it is "")."""
    if c.get("compile_cache_dir"):
        jax.config.update("jax_compilation_cache_dir", resolve_path(c.compile_cache_dir))


# ------------------------------------------------------------------------------------------------
# Sections -> dataclasses (the only place a config field is mapped onto a library field).
_CLASS_OF_SECTION = {
    "sampler": "SamplerConfig",
    "rollout": "RolloutConfig",
    "estimator": "EstimatorConfig",
    "estimator.controller": "EpsilonController",
    "ppo": "PPOLossConfig",
}


# Dataclass fields filled from another section than the one being built.
_FIELD_OF = {
    "config.rollout.action_key": "config.estimator.key",
    "config.rollout.game": "config.env.name",
    "config.rollout.max_steps": "config.env.max_steps",
    "config.estimator.controller.epsilon": "config.estimator.epsilon",
    "config.ppo.temperature": "config.sampler.temperature",
}


def _checked(section: str, build):
    """``build()``, its ``ValueError`` re-raised as a ``ConfigError`` under the config's field name."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        msg = str(e).replace(f"{_CLASS_OF_SECTION[section]}.", f"config.{section}.")
        for field, name in _FIELD_OF.items():
            msg = re.sub(rf"{re.escape(field)}\b", name, msg)
        raise ConfigError(msg if msg.startswith("config.") else f"config.{section}: {msg}") from None


def epsilon_controller(c: ml_collections.ConfigDict) -> EpsilonController | None:
    """The online epsilon controller of ``c.estimator.controller`` (None when disabled: the paper's fixed epsilon)."""
    cc = c.estimator.controller
    return EpsilonController(epsilon=c.estimator.epsilon, **cc.to_dict()) if cc.enabled else None


def stop_token_ids(eos_token_ids: Sequence[int], tokenizer: Any, checkpoint: str = "") -> tuple[int, ...]:
    """The ids a response stops on: the union, in first-seen order, of the model config's
    ``eos_token_ids`` (config.json), the checkpoint folder's ``generation_config.json`` ``eos_token_id``
    (when ``checkpoint`` is a folder holding one) and the tokenizer's EOS token.

    Qwen2.5-Instruct's config.json names ``<|endoftext|>`` (151643) while the chat turn ends with
    ``<|im_end|>`` (151645), which generation_config.json and the tokenizer add.
    """
    ids = [int(i) for i in eos_token_ids]
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "generation_config.json")):
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(checkpoint).eos_token_id
        ids += [int(i) for i in (gen if isinstance(gen, (list, tuple)) else [gen]) if i is not None]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def system_prompt_of(value: str) -> str | None:
    """A config's system prompt -> ``RolloutConfig.system_prompt``: ``"default"`` -> None (the chat
    template's own: Qwen2.5 inserts its default, the project's tiny template none), else the text
    (``""`` = an empty system turn). RL and the warm start both map it here, so their prompts agree."""
    return None if value == "default" else value


def build_actor(c: ml_collections.ConfigDict, tokenizer: Any, mesh: Any = None) -> Qwen2Actor:
    """The actor of ``c.model``: loaded from ``checkpoint``, or a random ``preset`` init.

    A random tiny init takes its sizes from ``model.*`` and its vocabulary and EOS from the tokenizer;
    parameters are drawn from ``nnx.Rngs(c.seed)``. ``mesh``: a checkpoint's tensors load straight
    into their ``NamedSharding`` on it (each device reads only its shard; see ``load_hf_checkpoint``);
    None: onto the default device.
    """
    m, dtype = c.model, _DTYPES[c.model.dtype]
    if m.checkpoint:
        # param_dtype too: bf16 parameters would make AdamW's small updates round away
        actor = load_hf_checkpoint(
            resolve_path(m.checkpoint),
            mesh=mesh,
            dtype=dtype,
            param_dtype=_DTYPES[m.param_dtype],
            fingerprint_layer=m.fingerprint_layer,
        )
        actor.matmul_precision, actor.remat, actor.scan_layers = m.matmul_precision, m.remat, m.scan_layers
        return actor
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if m.preset == "tiny" else None
    return init_actor(c, actor_architecture(c, len(tokenizer), eos))


def actor_architecture(c: ml_collections.ConfigDict, vocab_size: int, eos_token_id: int | None = None) -> Qwen2Config:
    """The ``Qwen2Config`` of a random init of ``c.model``: the named ``preset``, or for "tiny" the sizes
    ``model.*`` with ``vocab_size`` and ``eos_token_id`` (None: ``Qwen2Config.tiny``'s)."""
    m = c.model
    if m.preset != "tiny":
        return Qwen2Config.preset(m.preset)
    sizes = dict(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers)
    heads = dict(num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads)
    eos = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    return Qwen2Config.tiny(vocab_size=vocab_size, max_position_embeddings=8192, **eos, **sizes, **heads)


def init_actor(c: ml_collections.ConfigDict, cfg: Qwen2Config) -> Qwen2Actor:
    """A ``Qwen2Actor`` of architecture ``cfg`` with ``c.model``'s fingerprint layer, dtypes, matmul
    precision, remat policy and layer scan; parameters drawn from ``nnx.Rngs(c.seed)`` (under
    ``nnx.eval_shape``: shapes only)."""
    m = c.model
    return Qwen2Actor(
        cfg,
        fingerprint_layer=m.fingerprint_layer,
        dtype=_DTYPES[m.dtype],
        param_dtype=_DTYPES[m.param_dtype],
        rngs=nnx.Rngs(c.seed),
        matmul_precision=m.matmul_precision,
        remat=m.remat,
        scan_layers=m.scan_layers,
    )


def ppo_learner(c: ml_collections.ConfigDict, actor: Qwen2Actor, mesh, local_mesh, *, support: int) -> PPOLearner:
    """The ``PPOLearner`` of ``c.ppo`` (batching, old log-probs), ``c.optim`` and the sampler's length buckets;
    ``support``: the tokenizer's size (ids the sampler can draw)."""
    p = c.ppo
    return PPOLearner(
        actor,
        mesh,
        loss_config(c),
        make_optimizer(c.optim),
        local_mesh=local_mesh,
        epochs=p.epochs,
        micro_batch_rows=p.micro_batch_rows,
        mini_batch_rows=p.mini_batch_rows,
        fused_old_logprobs=p.old_logprobs == "fused",
        prompt_buckets=c.sampler.length_buckets,
        support=min(support, actor.config.vocab_size),
        logprob_chunk=p.logprob_chunk,
    )


def sampler_config(
    c: ml_collections.ConfigDict, *, temperature: float | None = None, eos_token_ids: tuple[int, ...] | None = None
) -> SamplerConfig:
    """``SamplerConfig`` of ``c.sampler`` (``temperature`` overrides it, e.g. ``val.temperature``)."""
    s = c.sampler
    return SamplerConfig(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature if temperature is None else temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        greedy=False,
        stop_strings=tuple(s.stop_strings),
        batch_buckets=tuple(s.batch_buckets),
        length_buckets=tuple(s.length_buckets),
        eos_token_ids=eos_token_ids,
    )


def rollout_config(c: ml_collections.ConfigDict, *, group_size: int) -> RolloutConfig:
    """``RolloutConfig`` of ``c.rollout`` with the game and step cap of ``c.env`` and the PACE key of
    ``c.estimator``; ``group_size`` is ``rollout.group_size`` for training, ``val.group_size`` for validation.
    ``rollout.fallback_action=""`` leaves the game's ``GameSpec.fallback_action``."""
    r = c.rollout
    return RolloutConfig(
        game=c.env.name,
        group_size=group_size,
        max_steps=c.env.max_steps,
        history_length=r.history_length,
        max_prompt_length=r.max_prompt_length,
        invalid_penalty=r.invalid_penalty,
        success_reward=r.success_reward,
        require_think=r.require_think,
        reject_cjk=r.reject_cjk,
        invalid_action=r.invalid_action,
        projection_chars=r.projection_chars,
        length_finish=r.length_finish,
        reset_retries=r.reset_retries,
        action_key=c.estimator.key,
        show_inventory=r.show_inventory,
        system_prompt=system_prompt_of(r.system_prompt),
        template=resolve_template(r.template),
        fallback_action=r.fallback_action or None,
    )


def loss_config(c: ml_collections.ConfigDict) -> losses.PPOLossConfig:
    """``PPOLossConfig`` of ``c.ppo``; the trained policy is the one that played, softmax(logits / rollout
    temperature), as in verl."""
    p = c.ppo
    return losses.PPOLossConfig(
        clip_eps=p.clip_eps,
        dual_clip=p.dual_clip or None,
        kl_coef=p.kl_coef,
        entropy_coef=p.entropy_coef,
        kl_bound=p.kl_bound,
        temperature=c.sampler.temperature,
    )


def estimator_config(c: ml_collections.ConfigDict, epsilon: float | None = None) -> EstimatorConfig:
    """``EstimatorConfig`` of ``c.estimator``; ``epsilon`` overrides it (calibrated or controlled)."""
    e = c.estimator
    return EstimatorConfig(
        name=e.name,
        gamma=e.gamma,
        omega=e.omega,
        norm=e.norm,
        epsilon=e.epsilon if epsilon is None else epsilon,
        centroid=e.centroid,
        key=e.key,
        capacity=e.capacity or None,
        penalty=e.penalty,
        episode_stats=e.episode_stats,
        step_norm=e.step_norm,
        pace_fallback=e.pace_fallback,
    )


def make_optimizer(optim: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after global-norm clipping; constant LR after linear warmup."""
    lr = (
        optax.linear_schedule(0.0, optim.learning_rate, optim.warmup_steps)
        if optim.warmup_steps
        else optim.learning_rate
    )
    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    )


GAME_OPTION_FIELDS = ("env.options", "val.options", "val.holdout_options")


def game_options(c: ml_collections.ConfigDict, field: str) -> dict[str, Any]:
    """The game keyword options of a config field (``GAME_OPTION_FIELDS``): "" -> {}, else a JSON object.

    Raises:
      ConfigError: naming the field, when the text is not a JSON object.
    """
    text = _get(c, field)
    if not isinstance(text, str):
        _fail(field, "be a string ('' or a JSON object of game options)", text)
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.{field} must be '' or a JSON object of game options, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        _fail(field, "be '' or a JSON object of game options", text)
    return value


def resolve_template(spec: str) -> Any:
    """A prompt template from a config string: "" (the game's default), a JSON object of
    ``PromptTemplate`` field overrides, or ``"module:ATTR"`` naming such a mapping.

    Raises:
      ConfigError: a reference that does not import or a malformed JSON object.
    """
    if not spec:
        return None
    if spec.lstrip().startswith("{"):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.rollout.template must be valid JSON, got {spec!r} ({e})") from None
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config.rollout.template must name 'module:ATTR', got {spec!r} ({e})") from None
