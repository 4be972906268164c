"""The RL trainer: rollout -> old/reference log-probs -> advantages -> PPO updates, in one loop.

One iteration (``Trainer.train_iteration``):

1. **Rollout** (``bipace_jax.rollout.collect``): this host's share of the iteration's task groups,
   G games each, played in lockstep by the KV-cache sampler at the rollout temperature. The
   BiPACE fingerprints come out of the sampler's prefill (the hidden state at the last prompt token);
   no forward pass is spent on them.
2. **Old log-probabilities**: one forward of the current policy over prompt + response
   (``ppo.old_logprobs="recompute"``, verl's default); the sampler's own log-probabilities
   (``"sampler"``, exact without top-p/top-k: both are ``log_softmax(logits / T)`` at the rollout
   temperature T, the policy PPO trains, ``PPOLossConfig.temperature``); or ``"fused"``: ``stop_gradient`` of the current
   log-probs inside the gradient pass, exact when an iteration makes one optimizer step
   (``ppo.epochs=1``, ``ppo.mini_batch_rows=0``) and one forward cheaper.
3. **Reference log-probabilities**: the same forward with the frozen initial parameters (skipped when
   ``ppo.kl_coef == 0``).
4. **Advantages**: ``compute_advantages(res.steps, EstimatorConfig)`` (spec ``estimators.md``).
5. **PPO**: ``ppo.epochs`` passes over the rows, shuffled, split into mini-batches (one AdamW step
   each) and fixed-shape micro-batches whose gradients are accumulated; the token mean of each
   mini-batch is exact (the denominator is the mini-batch's real-token count over all hosts). A NaN or
   Inf loss or gradient stops the run with ``NonFiniteError`` before the update is applied, so the
   last checkpoint stays the last good state.

Shapes: N step rows, P prompt columns (left-padded, bucketed), M = ``sampler.max_new_tokens``
response columns (right-padded), T = P + M, V vocabulary, B micro-batch rows.

Multi-host: every process runs its own env pool and sampler on a host-local copy of the parameters
for its contiguous share of the task groups (``num_groups / process_count``); the gradient step is
one global ``jax.jit`` over a mesh of all devices, the batch sharded over ("data", "fsdp"), so the
gradient all-reduce is XLA's. Host metrics are summed with ``process_allgather``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import configs as configs_lib
from bipace_jax import losses
from bipace_jax.checkpointing import Checkpointer
from bipace_jax.metrics import MetricsLogger, make_plots

log = logging.getLogger(__name__)

TRAIN_SEED_RANGE = 1_000_000  # training game seeds lie in [0, 10^6); validation seeds at or above it


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN/Inf; the update was not applied."""


# ------------------------------------------------------------------------------------------------
# Tasks.
def select_tasks(selector: str, num_tasks: int, task_info: Callable[[int], dict]) -> list[int]:
    """Task ids matched by a selector string (syntax in ``configs/base.py``), ascending.

    ``"all"``; ``"a:b"`` (range); ``"i,j,k"``; ``"key=v1,v2"`` (``task_info(id)[key]`` printed equals
    one of the values); parts joined with ``"&"`` intersect. ``""`` selects nothing.

    Raises:
      ValueError: an id outside ``[0, num_tasks)`` or a selector that matches no task.
    """
    if selector.strip() == "":
        return []
    ids = set(range(num_tasks))
    for part in selector.split("&"):
        part = part.strip()
        if part == "all":
            continue
        if "=" in part:
            key, values = part.split("=", 1)
            wanted = {v.strip() for v in values.split(",")}
            ids &= {i for i in range(num_tasks) if str(task_info(i).get(key.strip())) in wanted}
        elif ":" in part:
            a, b = (int(x) for x in part.split(":"))
            if not 0 <= a < b <= num_tasks:
                raise ValueError(f"task selector {selector!r}: range {a}:{b} must lie in [0, {num_tasks}]")
            ids &= set(range(a, b))
        else:
            sel = {int(x) for x in part.split(",")}
            bad = sorted(i for i in sel if not 0 <= i < num_tasks)
            if bad:
                raise ValueError(f"task selector {selector!r}: ids {bad} outside [0, {num_tasks})")
            ids &= sel
    if not ids:
        raise ValueError(f"task selector {selector!r} matches no task")
    return sorted(ids)


def train_task(train_ids: list[int], seed: int, index: int) -> tuple[int, int]:
    """(task_id, game_seed) of global task group number ``index`` of a run.

    The train ids are visited in epochs, each a fresh permutation seeded by ``(seed, epoch)``; the game
    seed of every group is drawn from ``(seed, index)`` in ``[0, TRAIN_SEED_RANGE)`` (validation seeds
    are ``>= TRAIN_SEED_RANGE``: never a training game).
    """
    epoch, k = divmod(index, len(train_ids))
    perm = np.random.default_rng([seed, epoch, 7]).permutation(len(train_ids))
    game_seed = int(np.random.default_rng([seed, index, 11]).integers(0, TRAIN_SEED_RANGE))
    return train_ids[int(perm[k])], game_seed


def split_holdout(ids: list[int], holdout: list[int], every: int) -> tuple[list[int], list[int]]:
    """(training ids, held-out ids): ``holdout`` plus every ``every``-th id of ``ids`` (ascending;
    positions every-1, 2*every-1, ...; 0 = none) are held out and removed from training."""
    ids = sorted(ids)
    held = set(holdout) | (set(ids[every - 1::every]) if every else set())
    return [t for t in ids if t not in held], sorted(held)


def validation_panel(seen: list[int], heldout: list[int], num_seen: int, num_heldout: int, seed_base: int,
                     mode: str = "spread", seeds_per_goal: int = 1) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The fixed validation panels ``(seen goals, held-out goals)`` of ``(task_id, game_seed)`` pairs.

    ``mode="spread"``: ``num_seen`` goals evenly spaced over ``seen`` (``linspace`` indices, rounded)
    and ``num_heldout`` over ``heldout`` (all when fewer), each played with ``seeds_per_goal`` game
    seeds (goal by goal); the seeds are ``seed_base + k`` with k running over both panels in that
    order. ``mode="random"``: distinct goals drawn with ``seed_base``, each with ``seeds_per_goal``
    seeds drawn in ``[seed_base, 2^31)``. ``seed_base >= TRAIN_SEED_RANGE`` keeps every panel game
    unseen in training (new distractors).
    """
    if mode == "spread":
        def pick(ids, n):
            if n >= len(ids):
                return list(ids)
            return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, n).round()] if n else []

        goals = pick(list(seen), num_seen), pick(list(heldout), num_heldout)
        seeds = iter(range(seed_base, seed_base + seeds_per_goal * (len(goals[0]) + len(goals[1]))))
        return tuple([(t, next(seeds)) for t in g for _ in range(seeds_per_goal)] for g in goals)
    if mode != "random":
        raise ValueError(f"validation panel mode must be 'spread' or 'random', got {mode!r}")
    rng = np.random.default_rng(seed_base)
    out = []
    for ids, n in ((seen, num_seen), (heldout, num_heldout)):
        chosen = rng.permutation(len(ids))[: min(n, len(ids))]
        seeds = rng.integers(seed_base, 2**31 - 1, size=(len(chosen), seeds_per_goal))
        out.append([(ids[int(i)], int(s)) for i, row in zip(chosen, seeds) for s in row])
    return out[0], out[1]


def resolve_template(spec: str) -> Any:
    """A prompt template from a config string: "" (the game's default), a JSON object of
    ``PromptTemplate`` field overrides, or ``"module:ATTR"`` naming such a mapping.

    Raises:
      configs.ConfigError: a reference that does not import or a malformed JSON object.
    """
    if not spec:
        return None
    if spec.lstrip().startswith("{"):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise configs_lib.ConfigError(f"config.rollout.template must be valid JSON, got {spec!r} ({e})") from None
    import importlib

    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise configs_lib.ConfigError(f"config.rollout.template must name 'module:ATTR', got {spec!r} ({e})") from None


# ------------------------------------------------------------------------------------------------
# Model and tokenizer.
def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def build_game_tokenizer(config: ml_collections.ConfigDict, path: str, num_tasks: int = 64) -> Any:
    """Train a small byte-level BPE on the game's own text and save it as an HF tokenizer folder.

    The corpus is the prompts (the config's template and options) and expert actions of ``num_tasks``
    oracle episodes of ``config.env``, so the vocabulary fits the game. (The shipped warm start has
    its own, richer tokenizer: ``launch/build_tokenizer.py``.) Special tokens:
    ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS of a response); the Qwen2.5 chat
    template is added by ``load_tokenizer``. Deterministic for a config. Returns the loaded tokenizer.
    """
    import environments
    from environments.prompts import build_prompt
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from bipace_jax.models import load_tokenizer

    env = environments.make(config.env.name, max_steps=config.env.max_steps)
    template = resolve_template(config.rollout.template)
    texts = []
    for i in range(num_tasks):
        task = (i * 7919) % env.num_tasks
        obs = env.reset(task, i)
        history = []
        for step in range(config.env.max_steps):
            texts.append(build_prompt(config.env.name, obs, history, step,
                                      history_length=min(config.rollout.history_length, len(history)),
                                      template=template, show_inventory=config.rollout.show_inventory))
            action = env.oracle_action()
            if action is None:
                break
            texts.append(f"<think>I will {action}.</think><action>{action}</action>")
            new_obs, _, done, _ = env.step(action)
            history.append((obs.text, action))
            obs = new_obs
            if done:
                break
    texts.append("You are a helpful assistant. system user assistant")
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.model.vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return load_tokenizer(path)


def build_actor(config: ml_collections.ConfigDict, tokenizer: Any) -> nnx.Module:
    """The actor of a run: loaded from ``model.checkpoint``, or a random ``model.preset`` init.

    A random tiny init takes its sizes from ``model.*`` and its vocabulary and EOS from the tokenizer;
    parameters are drawn from ``nnx.Rngs(config.seed)``.
    """
    from bipace_jax.models import Qwen2Actor, Qwen2Config, load_hf_checkpoint

    m = config.model
    if m.checkpoint:
        return load_hf_checkpoint(configs_lib.resolve_path(m.checkpoint), dtype=_dtype(m.dtype), fingerprint_layer=m.fingerprint_layer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if m.preset == "tiny":
        cfg = Qwen2Config.tiny(vocab_size=len(tokenizer), hidden_size=m.hidden_size,
                               intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                               num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                               eos_token_id=eos, max_position_embeddings=8192)
    else:
        cfg = Qwen2Config.preset(m.preset)
    return Qwen2Actor(cfg, fingerprint_layer=m.fingerprint_layer, dtype=_dtype(m.dtype),
                      param_dtype=_dtype(m.param_dtype), rngs=nnx.Rngs(config.seed))


def make_optimizer(optim: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after global-norm clipping; constant LR after linear warmup."""
    if optim.warmup_steps:
        lr = optax.linear_schedule(0.0, optim.learning_rate, optim.warmup_steps)
    else:
        lr = optim.learning_rate
    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    )


# ------------------------------------------------------------------------------------------------
# Multi-host helpers.
def initialize_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """``jax.distributed.initialize`` from explicit values or the environment.

    Explicit values win; otherwise ``BIPACE_COORDINATOR`` / ``BIPACE_NUM_PROCESSES`` /
    ``BIPACE_PROCESS_ID``; otherwise, on Cloud TPU / SLURM / etc., JAX's own auto-detection when
    ``BIPACE_DISTRIBUTED=auto``. Without any of these it does nothing (single process).
    """
    coord = coordinator_address or os.environ.get("BIPACE_COORDINATOR", "")
    n = num_processes or int(os.environ.get("BIPACE_NUM_PROCESSES", "0"))
    pid = process_id if process_id >= 0 else int(os.environ.get("BIPACE_PROCESS_ID", "-1"))
    if coord:
        if n < 1 or pid < 0:
            raise ValueError(f"distributed: coordinator {coord!r} needs num_processes >= 1 and process_id >= 0, "
                             f"got {n} and {pid}")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coord, num_processes=n, process_id=pid)
    elif os.environ.get("BIPACE_DISTRIBUTED") == "auto":
        jax.distributed.initialize()


def _allgather(x: np.ndarray) -> np.ndarray:
    """Stack a host-local array over processes: ``[num_processes, *x.shape]``."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _host_local(tree: Any, local_shardings: Any = None) -> Any:
    """A host-local copy of a pytree of (possibly multi-host) global arrays, placed on
    ``local_shardings`` (over this host's devices; default its first device). One process: the tree."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    def full(x):
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    if local_shardings is None:
        dev = jax.local_devices()[0]
        return jax.tree.map(lambda x: jax.device_put(full(x), dev), tree)
    return jax.tree.map(lambda x, s: jax.device_put(full(x), s), tree, local_shardings)


def local_mesh_for(mesh, tensor: int):
    """The mesh a host samples on: the global mesh with one process; else this host's devices with
    (data, fsdp=1, tensor) where tensor is the config's when it divides the local device count."""
    from bipace_jax import sharding as sharding_lib

    if jax.process_count() == 1:
        return mesh
    n = jax.local_device_count()
    t = tensor if tensor > 0 and n % tensor == 0 else 1
    return sharding_lib.make_mesh(-1, 1, t, devices=jax.local_devices())


def _to_global(tree: Any, shardings: Any) -> Any:
    """Place a host-local pytree (identical on every process) onto global shardings."""
    def one(x, s):
        a = np.asarray(x)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(one, tree, shardings)


# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    """Host-side token arrays of one iteration's rows (numpy)."""

    input_ids: np.ndarray      # int32[N, T]  prompt (left-padded) + response (right-padded)
    attention_mask: np.ndarray  # int32[N, T]
    response_ids: np.ndarray   # int32[N, M]
    response_mask: np.ndarray  # bool[N, M]
    prompt_len: int            # P

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


@functools.lru_cache(maxsize=16)
def _ppo_programs(graphdef, cfg: losses.PPOLossConfig, tx: optax.GradientTransformation, fused_old: bool = False):
    """The jitted programs of a learner, shared by learners of the same model, loss and optimizer.

    ``fused_old``: the old log-probs are ``stop_gradient`` of the current ones inside the gradient
    pass (exact when the iteration makes one optimizer step: every micro-batch's gradient is taken at
    the behaviour policy's parameters); ``mb["old_logprobs"]`` then carries the sampler's log-probs,
    used only for the ``sampler_gap`` statistic.
    """

    def response_logits(params, rest, input_ids, attention_mask, prompt_len):
        model = nnx.merge(graphdef, params, rest)
        h, _ = model.forward_hidden(input_ids, attention_mask)  # [B, T, D]
        # The LM head runs on the M positions that predict response tokens only (position t predicts
        # token t + 1), not on [B, T, V]: with a 152k vocabulary that is most of the memory.
        return model.lm_logits(h[:, prompt_len - 1: -1])  # [B, M, V] fp32

    @jax.jit
    def logprobs_fn(params, rest, input_ids, attention_mask, response_ids):
        prompt_len = input_ids.shape[1] - response_ids.shape[1]
        logits = response_logits(params, rest, input_ids, attention_mask, prompt_len)
        return losses.token_logprobs(logits, response_ids, cfg.temperature)

    def loss_fn(params, rest, mb, denom):
        prompt_len = mb["input_ids"].shape[1] - mb["response_ids"].shape[1]
        logits = response_logits(params, rest, mb["input_ids"], mb["attention_mask"], prompt_len)
        ref = mb["ref_logprobs"] if cfg.kl_coef > 0 else None
        old = mb["old_logprobs"]
        gap = jnp.zeros((), jnp.float32)
        if fused_old:
            logp = losses.token_logprobs(logits, mb["response_ids"], cfg.temperature)
            gap = losses.token_mean(jnp.abs(old - logp), mb["response_mask"], denom)
            old = jax.lax.stop_gradient(logp)
        loss, m = losses.ppo_loss(logits, mb["response_ids"], mb["response_mask"], old, ref,
                                  mb["advantages"], cfg, denom)
        return loss, dict(m, sampler_gap=gap)

    @jax.jit
    def grad_fn(params, rest, grads_acc, stats_acc, mb, denom):
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, mb, denom)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        stats_acc = jax.tree.map(jnp.add, stats_acc, dict(m, loss=loss))
        return grads_acc, stats_acc

    def apply_fn(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))
    return logprobs_fn, grad_fn, jax.jit(apply_fn, donate_argnums=(0, 1)), zeros, jax.jit(optax.tree.norm)


class PPOLearner:
    """Parameters, optimizer and the jitted PPO programs of a run (no games, no files).

    Args:
      actor: the (host-local) actor; its parameters become the learner's global parameters.
      mesh: the global mesh (axes data, fsdp, tensor); parameters follow ``sharding.param_shardings``,
        micro-batches are split over ("data", "fsdp").
      loss_cfg: PPO coefficients.
      tx: the optax transformation (``make_optimizer``).
      micro_batch_rows: B, rows per forward/backward on this process (fixed shape).
      mini_batch_rows: rows per optimizer step on this process (0: all rows, one step per epoch).
      epochs: passes over the rows per ``update``.

      fused_old_logprobs: take the old log-probs inside the gradient pass (``stop_gradient`` of the
        current ones) instead of a separate forward; requires one optimizer step per ``update``
        (``epochs == 1``, ``mini_batch_rows == 0``); ``update``'s ``old_lp`` is then the sampler's
        log-probs, reported as ``loss/sampler_gap``.
      prompt_buckets: prompt lengths a micro-batch may be cut down to (the sampler's length
        buckets); () keeps every micro-batch at the iteration's ``Batch.prompt_len``.
      local_mesh: the mesh of this host's devices for sampling and the log-prob forwards (default:
        ``mesh`` with one process, else the host's first device).

    ``params`` are global arrays; ``params_local`` a host-local copy that the sampler and the
    log-prob forwards use (the same arrays on one process). ``ref_params_local``: the frozen initial
    parameters (None when ``loss_cfg.kl_coef == 0``).
    """

    STAT_KEYS = ("pg_loss", "kl", "entropy", "clip_frac", "approx_kl_old", "sampler_gap", "loss")

    def __init__(self, actor: nnx.Module, mesh, loss_cfg: losses.PPOLossConfig, tx: optax.GradientTransformation,
                 *, micro_batch_rows: int, mini_batch_rows: int = 0, epochs: int = 1, local_mesh=None,
                 fused_old_logprobs: bool = False, prompt_buckets: Sequence[int] = ()):
        from bipace_jax import sharding as sharding_lib

        self.actor, self.mesh, self.loss_cfg, self.tx = actor, mesh, loss_cfg, tx
        self.micro_batch_rows, self.mini_batch_rows, self.epochs = micro_batch_rows, mini_batch_rows, epochs
        if fused_old_logprobs and (epochs != 1 or mini_batch_rows != 0):
            raise ValueError(f"fused_old_logprobs needs one optimizer step per update (epochs=1, mini_batch_rows=0), "
                             f"got epochs={epochs}, mini_batch_rows={mini_batch_rows}")
        self.fused_old_logprobs = fused_old_logprobs
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self.graphdef, params, self._rest = nnx.split(actor, nnx.Param, ...)
        self.param_shardings = sharding_lib.param_shardings(params, mesh)
        self.params = _to_global(params, self.param_shardings)
        self.opt_state = jax.jit(tx.init)(self.params)
        self.local_shardings = None
        if local_mesh is not None and jax.process_count() > 1:
            self.local_shardings = sharding_lib.param_shardings(params, local_mesh)
        self.ref_params_local = None
        if loss_cfg.kl_coef > 0:
            self.ref_params_local = jax.tree.map(jnp.copy, _host_local(self.params, self.local_shardings))
        self._build_programs()
        self.sync_local()

    def sync_local(self) -> None:
        """Refresh the host-local parameters and point the actor at them (after an update/restore)."""
        self.params_local = _host_local(self.params, self.local_shardings)
        nnx.update(self.actor, self.params_local)

    def _build_programs(self):
        (self._logprobs_fn, self._grad_fn, self._apply_fn, self._zeros,
         self._global_norm) = _ppo_programs(self.graphdef, self.loss_cfg, self.tx, self.fused_old_logprobs)

    def logprobs(self, params_local: Any, batch: Batch) -> np.ndarray:
        """float32[N, M] log-probs of the responses under ``params_local`` (host-local, micro-batched).

        The same forward also yields fingerprints, but the run never needs them from here: they come
        from the rollout's prefill.
        """
        B = self.micro_batch_rows
        out = np.zeros(batch.response_ids.shape, np.float32)
        plen = _prompt_lengths(batch)
        order = np.argsort(plen, kind="stable")  # similar lengths share a micro-batch
        for s in range(0, batch.rows, B):
            r = order[s:s + B]
            width = self._prompt_width(int(plen[r].max()), batch.prompt_len)
            ids, att = (self._micro_rows(x, r, batch, width) for x in (batch.input_ids, batch.attention_mask))
            resp = _pad_rows(batch.response_ids[r], B)
            att[:, -1] |= (att.sum(1) == 0)  # padding rows get one real token (no empty softmax)
            lp = self._logprobs_fn(params_local, self._rest, jnp.asarray(ids), jnp.asarray(att), jnp.asarray(resp))
            out[r] = np.asarray(lp)[: len(r)]
        return out

    def _prompt_width(self, need: int, widest: int) -> int:
        """Prompt columns a micro-batch whose longest prompt has ``need`` tokens is given: the smallest
        of ``prompt_buckets`` that holds it, else ``widest`` (the batch's prompt length, agreed over
        processes in ``update``). Padding columns carry attention mask 0 and positions come from the
        mask, so the log-probs do not depend on it (a few programs compile, one per bucket)."""
        fit = [b for b in self.prompt_buckets if max(need, 1) <= b]
        return min(fit[0], widest) if fit else widest

    def _micro_rows(self, x: np.ndarray, rows: np.ndarray, batch: "Batch", width: int) -> np.ndarray:
        """``x[rows]`` ([n, P + M] token columns) with its prompt part cut, or left-padded with zero
        columns, to ``width`` and its rows padded to the micro-batch size."""
        x, P_ = x[rows], batch.prompt_len
        if width <= P_:
            x = x[:, P_ - width:]
        else:
            x = np.concatenate([np.zeros((x.shape[0], width - P_), x.dtype), x], 1)
        return _pad_rows(x, self.micro_batch_rows)

    def update(self, batch: Batch, old_lp: np.ndarray, ref_lp: np.ndarray | None, adv: np.ndarray,
               key: jax.Array, where: str = "") -> dict[str, float]:
        """Mini-batch PPO with gradient accumulation over fixed-shape micro-batches.

        Every process must call it (with its own rows); the number of mini- and micro-batches is
        agreed over processes, a process short of rows contributes all-padding micro-batches. The
        token-mean denominator of a mini-batch is its real-token count summed over processes.

        Args:
          batch: this process's rows (N).
          old_lp, ref_lp: float32[N, M] (ref may be None when kl_coef == 0).
          adv: float32[N] row advantages.
          key: shuffling key.
          where: text naming the iteration, for the error message.

        Returns:
          metrics ``loss/*`` averaged over the optimizer steps, ``loss/grad_norm`` (before clipping).

        Raises:
          NonFiniteError: NaN/Inf loss or gradient; that step is not applied.
        """
        B = self.micro_batch_rows
        n_local = batch.rows
        counts = _allgather(np.array([n_local], np.int64))[:, 0]
        mb_rows = self.mini_batch_rows or int(max(counts.max(), 1))
        n_mini = max(int(math.ceil(counts.max() / mb_rows)), 1)
        totals = {k: 0.0 for k in self.STAT_KEYS}
        gnorms = []
        plen = _prompt_lengths(batch)
        # Every process's micro-batch must have the same shape: the widest prompt length of all.
        widest = int(_allgather(np.array([batch.prompt_len], np.int64)).max())
        for epoch in range(self.epochs):
            perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), n_local)) if n_local else np.zeros(0, int)
            # Within a mini-batch the rows are ordered by prompt length (the sum of the gradients
            # does not depend on the order) so each micro-batch keeps only the prompt columns its
            # longest prompt needs (``_prompt_width``), a length agreed over processes.
            minis = [perm[j * mb_rows:(j + 1) * mb_rows] for j in range(n_mini)]
            minis = [r[np.argsort(plen[r], kind="stable")] for r in minis]
            info = _allgather(np.array([[len(r), int(batch.response_mask[r].sum())] for r in minis], np.int64))
            k_micros = [max(int(math.ceil(info[:, j, 0].max() / B)), 1) for j in range(n_mini)]
            needs = _allgather(np.array([int(plen[r[m * B:(m + 1) * B]].max(initial=1))
                                         for r, k in zip(minis, k_micros) for m in range(k)], np.int64)).max(0)
            widths = iter([self._prompt_width(int(nd), widest) for nd in needs])
            for j, rows in enumerate(minis):
                denom = float(max(info[:, j, 1].sum(), 1))
                k_micro = k_micros[j]
                grads = self._zeros(self.params)
                stats = {k: jnp.zeros((), jnp.float32) for k in self.STAT_KEYS}
                for m in range(k_micro):
                    r = rows[m * B:(m + 1) * B]
                    width = next(widths)
                    mb = {
                        "input_ids": self._micro_rows(batch.input_ids, r, batch, width),
                        "attention_mask": self._micro_rows(batch.attention_mask, r, batch, width),
                        "response_ids": _pad_rows(batch.response_ids[r], B),
                        "response_mask": _pad_rows(batch.response_mask[r], B),
                        "old_logprobs": _pad_rows(old_lp[r], B),
                        "ref_logprobs": _pad_rows(ref_lp[r] if ref_lp is not None else np.zeros_like(old_lp[r]), B),
                        "advantages": _pad_rows(adv[r], B),
                    }
                    mb["attention_mask"][:, -1] |= (mb["attention_mask"].sum(1) == 0)
                    mb = {k: jax.make_array_from_process_local_data(
                        NamedSharding(self.mesh, P(("data", "fsdp"), *([None] * (v.ndim - 1)))), v)
                        for k, v in mb.items()}
                    grads, stats = self._grad_fn(self.params, self._rest, grads, stats, mb, jnp.float32(denom))
                stats = {k: float(v) for k, v in stats.items()}
                gnorm = float(self._global_norm(grads))
                if not (math.isfinite(stats["loss"]) and math.isfinite(gnorm)):
                    raise NonFiniteError(
                        f"non-finite PPO update ({where}epoch {epoch}, mini-batch {j}): loss={stats['loss']}, "
                        f"grad_norm={gnorm}; the update was not applied")
                self.params, self.opt_state = self._apply_fn(self.params, self.opt_state, grads)
                for k in totals:
                    totals[k] += stats[k]
                gnorms.append(gnorm)
        out = {f"loss/{k}": v / len(gnorms) for k, v in totals.items()}
        out["loss/grad_norm"] = float(np.mean(gnorms))
        out["loss/grad_norm_max"] = float(np.max(gnorms))
        out["loss/updates"] = len(gnorms)
        self.sync_local()
        return out


class Trainer:
    """Owns the actor, optimizer, env pools, sampler, checkpoints and metrics of one run.

    Args:
      config: a validated ``configs/base.py``-layout config.
      workdir: run folder (metrics.jsonl, tb/, plots/, checkpoints/, tokenizer/, hf_final/).
      resume: restore the latest checkpoint in ``workdir`` when there is one (a run started again in
        the same folder continues; pass False to refuse, which raises if a checkpoint exists).
      actor, tokenizer: optional pre-built actor/tokenizer (hooks for warm starts and tests);
        default: ``build_actor`` / the checkpoint's or the project's game tokenizer.

    Raises:
      configs.ConfigError: a bad config field (before anything compiles).
      FileExistsError: ``resume=False`` and ``workdir`` already has checkpoints.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, resume: bool = True,
                 actor: nnx.Module | None = None, tokenizer: Any = None):
        from bipace_jax import sharding as sharding_lib

        configs_lib.validate(config, num_devices=jax.device_count())
        self.config = config
        self.workdir = workdir
        self.is_primary = jax.process_index() == 0
        self.num_hosts = jax.process_count()
        c = config
        if c.rollout.num_groups % self.num_hosts:
            raise configs_lib.ConfigError(
                f"config.rollout.num_groups must be a multiple of the process count {self.num_hosts}, got {c.rollout.num_groups}")
        os.makedirs(workdir, exist_ok=True)

        # --- mesh ------------------------------------------------------------------------------
        data, fsdp, tensor = configs_lib.mesh_shape(c, jax.device_count())
        self.mesh = sharding_lib.make_mesh(data, fsdp, tensor)
        if (c.ppo.micro_batch_rows * self.num_hosts) % (data * fsdp):
            raise configs_lib.ConfigError(
                f"config.ppo.micro_batch_rows x processes must be a multiple of mesh data*fsdp={data * fsdp}, "
                f"got {c.ppo.micro_batch_rows} x {self.num_hosts}")

        # --- tokenizer and actor ---------------------------------------------------------------
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        actor = actor if actor is not None else build_actor(c, self.tokenizer)
        self.actor = actor
        loss_cfg = losses.PPOLossConfig(
            clip_eps=c.ppo.clip_eps, dual_clip=c.ppo.dual_clip or None, kl_coef=c.ppo.kl_coef,
            entropy_coef=c.ppo.entropy_coef, kl_bound=c.ppo.kl_bound,
            # The trained policy is the one that played: softmax(logits / rollout temperature), as
            # in verl (greedy rollouts: temperature 1, as the sampler reports their log-probs).
            temperature=c.sampler.temperature if c.sampler.temperature > 0 else 1.0)
        self.local_mesh = local_mesh_for(self.mesh, c.mesh.tensor)
        self.learner = PPOLearner(actor, self.mesh, loss_cfg, make_optimizer(c.optim),
                                  micro_batch_rows=c.ppo.micro_batch_rows, mini_batch_rows=c.ppo.mini_batch_rows,
                                  epochs=c.ppo.epochs, local_mesh=self.local_mesh,
                                  fused_old_logprobs=c.ppo.old_logprobs == "fused",
                                  prompt_buckets=c.sampler.length_buckets)

        # --- run state (restored below) --------------------------------------------------------
        self.iteration = 0
        self.task_cursor = 0
        self.rng = jax.random.PRNGKey(c.seed)
        self.epsilon = float(c.estimator.epsilon)
        self.needs_calibration = bool(c.estimator.calibration.enabled)  # done on iteration 0
        self.controller = self._make_controller()
        self.checkpointer = Checkpointer(workdir, keep=c.checkpoint.keep)
        latest = self.checkpointer.latest_step()
        if latest is not None:
            if not resume:
                raise FileExistsError(f"{workdir} already holds checkpoints (latest step {latest}); "
                                      f"pass --resume or use a new --workdir")
            self._restore(latest)

        # --- tasks -----------------------------------------------------------------------------
        import environments

        probe = environments.make(c.env.name, max_steps=c.env.max_steps)
        self._task_info = probe.task_info
        train, holdout = split_holdout(select_tasks(c.tasks.train, probe.num_tasks, probe.task_info),
                                       select_tasks(c.tasks.holdout, probe.num_tasks, probe.task_info),
                                       c.tasks.holdout_every)
        if not train:
            raise configs_lib.ConfigError(f"config.tasks.train selects no task outside the held-out goals, got {c.tasks.train!r}")
        self.train_ids, self.holdout_ids = train, holdout
        self.val_panel, self.holdout_panel = validation_panel(
            train, holdout, c.val.num_tasks, c.val.num_holdout_tasks, c.val.seed, c.val.panel, c.val.seeds_per_goal)

        # --- rollout machinery ------------------------------------------------------------------
        from environments.pool import EnvPool

        from bipace_jax.rollout import RolloutConfig
        from bipace_jax.sampling import Sampler, SamplerConfig

        self.groups_per_host = c.rollout.num_groups // self.num_hosts
        val_rows = max(len(self.val_panel), len(self.holdout_panel)) * c.val.group_size
        val_rows = math.ceil(val_rows / self.num_hosts) if c.val.every or c.val.at_start else 0
        num_envs = max(self.groups_per_host * c.rollout.group_size, val_rows)
        pool_kw = dict(env_options={"max_steps": c.env.max_steps}, timeout_s=c.env.timeout_s)
        if c.env.num_workers:
            pool_kw["num_workers"] = c.env.num_workers
        self.pool = EnvPool(c.env.name, num_envs, **pool_kw)
        eos = tuple(self.actor.config.eos_token_ids) or None
        scfg = SamplerConfig(max_new_tokens=c.sampler.max_new_tokens, temperature=c.sampler.temperature,
                             top_p=c.sampler.top_p, top_k=c.sampler.top_k, greedy=False,
                             stop_strings=tuple(c.sampler.stop_strings), batch_buckets=tuple(c.sampler.batch_buckets),
                             length_buckets=tuple(c.sampler.length_buckets), eos_token_ids=eos)
        vcfg = dataclasses.replace(scfg, temperature=c.val.temperature)
        self.sampler = Sampler(self.tokenizer, scfg, mesh=self.local_mesh)
        self.val_sampler = Sampler(self.tokenizer, vcfg, mesh=self.local_mesh)
        rkw = dict(game=c.env.name, max_steps=c.env.max_steps, history_length=c.rollout.history_length,
                   max_prompt_length=c.rollout.max_prompt_length, invalid_penalty=c.rollout.invalid_penalty,
                   success_reward=c.rollout.success_reward, require_think=c.rollout.require_think,
                   action_key=c.estimator.key, show_inventory=c.rollout.show_inventory,
                   system_prompt=None if c.rollout.system_prompt == "default" else c.rollout.system_prompt,
                   template=resolve_template(c.rollout.template))
        if c.rollout.fallback_action:
            rkw["fallback_action"] = c.rollout.fallback_action
        self.rollout_cfg = RolloutConfig(group_size=c.rollout.group_size, sampler=scfg, **rkw)
        self.val_rollout_cfg = RolloutConfig(group_size=c.val.group_size, sampler=vcfg, **rkw)

        self.metrics = MetricsLogger(workdir, start_iteration=self.iteration, enabled=self.is_primary)
        if self.is_primary:
            with open(os.path.join(workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2))

    # ------------------------------------------------------------------------------------------
    def _load_tokenizer(self):
        from bipace_jax.models import load_tokenizer

        m = self.config.model
        if m.tokenizer:
            return load_tokenizer(configs_lib.resolve_path(m.tokenizer))
        if m.checkpoint:
            return load_tokenizer(configs_lib.resolve_path(m.checkpoint))
        path = os.path.join(self.workdir, "tokenizer")
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return load_tokenizer(path)
        if self.num_hosts > 1:
            raise configs_lib.ConfigError("config.model.tokenizer must be set for a multi-host random init, got ''")
        return build_game_tokenizer(self.config, path)

    def _make_controller(self):
        """The online epsilon controller (state saved in checkpoints); None when disabled (paper: fixed)."""
        cc = self.config.estimator.controller
        if not cc.enabled:
            return None
        from bipace_jax.estimators import EpsilonController

        return EpsilonController(epsilon=self.epsilon, target_singleton_rate=cc.target_singleton_rate,
                                 gain=cc.gain, max_step=cc.max_step, min_epsilon=cc.min_epsilon,
                                 max_epsilon=cc.max_epsilon, enabled=True)

    # ------------------------------------------------------------------------------------------
    def _restore(self, step: int) -> None:
        L = self.learner
        L.params, L.opt_state, rng, meta = self.checkpointer.restore(step, L.params, L.opt_state)
        L.sync_local()
        self.rng = rng
        self.iteration = int(meta["iteration"])
        self.task_cursor = int(meta["task_cursor"])
        if self.needs_calibration and self.iteration > 0:
            # calibrated on iteration 0 of this run: keep that value (a resumed run never re-calibrates)
            self.epsilon = float(meta["epsilon"])
            self.needs_calibration = False
        if self.controller is not None and meta.get("controller") is not None:
            # the controller's epsilon continues; a fixed epsilon comes from the config (overridable)
            self.controller.load_state_dict(meta["controller"])
            self.epsilon = float(self.controller.epsilon)
        if self.is_primary:
            log.info("resumed from %s step %d (iteration %d)", self.checkpointer.directory, step, self.iteration)

    def save_checkpoint(self) -> None:
        meta = {"iteration": self.iteration, "task_cursor": self.task_cursor, "epsilon": self.epsilon,
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "estimator": self.config.estimator.name, "seed": self.config.seed}
        self.checkpointer.save(self.iteration, self.learner.params, self.learner.opt_state, self.rng, meta)

    # ------------------------------------------------------------------------------------------
    def _calibrate_epsilon(self, steps) -> dict[float, float]:
        """Sets ``self.epsilon`` by the one-shot sweep (``calibrate_epsilon``) on this iteration's batch.

        Each host sweeps its own rows; the run takes the largest of the hosts' choices (the smallest
        grid value at which every host's singleton rate meets the target, the rate falling with
        epsilon). Returns this host's {epsilon: singleton_group_rate} for the values tried.

        Raises:
          ValueError: no grid value reaches ``estimator.calibration.target_singleton_rate`` (lists the rates).
        """
        from bipace_jax.estimators import calibrate_epsilon

        cc = self.config.estimator.calibration
        failure = None
        try:
            eps, rates = calibrate_epsilon(steps, target_singleton_rate=cc.target_singleton_rate, grid=tuple(cc.grid),
                                           centroid=self.config.estimator.centroid,
                                           capacity=self.config.estimator.capacity or None, return_rates=True)
        except ValueError as e:
            failure, eps, rates = str(e), 2.0, {}  # 2.0: "no value" (every host joins the gather below)
        chosen = float(_allgather(np.array([eps], np.float64))[:, 0].max())
        if chosen >= 1.0:
            raise ValueError(f"config.estimator.calibration: {failure or 'another host found no epsilon'} "
                             f"(raise target_singleton_rate or extend the grid)")
        self.epsilon = chosen
        if self.controller is not None:
            self.controller.epsilon = self.epsilon
        self.needs_calibration = False
        if self.is_primary:
            log.info("calibrated epsilon = %g (singleton rates %s)", self.epsilon, rates)
        return rates

    def _estimator_config(self):
        from bipace_jax.estimators import EstimatorConfig

        e = self.config.estimator
        return EstimatorConfig(name=e.name, gamma=e.gamma, omega=e.omega, norm=e.norm, epsilon=self.epsilon,
                               centroid=e.centroid, key=e.key, capacity=e.capacity or None)

    def _make_batch(self, res) -> Batch:
        """Token arrays for the update: [prompt (left-padded, bucketed) | response (padded to M)]."""
        M = self.config.sampler.max_new_tokens
        pid, pmask = np.asarray(res.prompt_ids, np.int32), np.asarray(res.prompt_mask, np.int32)
        rid, rmask = np.asarray(res.response_ids, np.int32), np.asarray(res.response_mask, bool)
        n, p = pid.shape
        buckets = [b for b in self.config.sampler.length_buckets if b >= p]
        P_ = buckets[0] if buckets else p
        if P_ > p:  # left-pad further to the bucket
            pid = np.concatenate([np.zeros((n, P_ - p), np.int32), pid], 1)
            pmask = np.concatenate([np.zeros((n, P_ - p), np.int32), pmask], 1)
        if rid.shape[1] < M:
            pad = M - rid.shape[1]
            rid = np.concatenate([rid, np.zeros((n, pad), np.int32)], 1)
            rmask = np.concatenate([rmask, np.zeros((n, pad), bool)], 1)
        elif rid.shape[1] > M:
            raise ValueError(f"rollout responses have {rid.shape[1]} columns, more than sampler.max_new_tokens={M}")
        rid = np.where(rmask, rid, 0)
        return Batch(np.concatenate([pid, rid], 1), np.concatenate([pmask, rmask.astype(np.int32)], 1),
                     rid, rmask, P_)

    # ------------------------------------------------------------------------------------------
    def _local_groups(self, start: int) -> list[tuple[int, int]]:
        g = self.groups_per_host
        first = start + jax.process_index() * g
        return [train_task(self.train_ids, self.config.seed, first + i) for i in range(g)]

    def train_iteration(self) -> dict[str, Any]:
        """Run iteration ``self.iteration`` and advance the run state (not the checkpoint)."""
        from bipace_jax.estimators import compute_advantages
        from bipace_jax.rollout import collect

        c = self.config
        t_start = time.perf_counter()
        self.rng, key = jax.random.split(self.rng)
        k_roll, k_ppo = jax.random.split(jax.random.fold_in(key, jax.process_index()))
        groups = self._local_groups(self.task_cursor)
        res = collect(self.actor, self.sampler, self.pool, self.tokenizer, [t for t, _ in groups],
                      [s for _, s in groups], self.rollout_cfg, k_roll, progress=c.log.progress and self.is_primary)
        t_roll = time.perf_counter()

        batch = self._make_batch(res)
        sample_lp = _pad_cols(np.asarray(res.sample_logprobs, np.float32), batch.response_ids.shape[1])
        if c.ppo.old_logprobs == "recompute":
            old_lp = self.learner.logprobs(self.learner.params_local, batch)
        else:  # "sampler", or "fused" (the gradient pass takes them; sample_lp feeds the gap statistic)
            old_lp = sample_lp
        t_old = time.perf_counter()
        # Sampler vs trainer log-probs of the same tokens: ~0 at temperature 1 (top-p/k off); a
        # large value means the sampling and training forwards disagree (positions, padding, dtype).
        lp_gap = float(np.abs(sample_lp - old_lp)[batch.response_mask].mean()) if batch.response_mask.any() else 0.0
        ref = self.learner.ref_params_local
        ref_lp = self.learner.logprobs(ref, batch) if ref is not None else None
        t_ref = time.perf_counter()

        calibrated = None
        if self.needs_calibration:
            calibrated = self._calibrate_epsilon(res.steps)
        adv, diag = compute_advantages(res.steps, self._estimator_config())
        adv = np.asarray(jax.block_until_ready(adv), np.float32)[: batch.rows]
        t_est = time.perf_counter()
        if not np.all(np.isfinite(adv)):
            raise NonFiniteError(f"non-finite advantages at iteration {self.iteration} from estimator "
                                 f"{c.estimator.name}; no update applied")

        try:
            upd = self.learner.update(batch, old_lp, ref_lp, adv, k_ppo, where=f"iteration {self.iteration}, ")
        except NonFiniteError as e:
            raise NonFiniteError(f"{e}; the last good checkpoint is step {self.checkpointer.latest_step()} "
                                 f"in {self.checkpointer.directory}") from None
        t_upd = time.perf_counter()

        rec = self._episode_metrics(res.episodes, "train")
        rec.update(upd)
        diag = {k: float(v) for k, v in diag.items()}
        for k, v in _mean_over_hosts(diag).items():
            rec[f"estimator/{k}"] = v
        rec["estimator/epsilon"] = self.epsilon
        if calibrated is not None:
            rec.update({f"estimator/calibration_singleton_rate/{e:g}": r for e, r in calibrated.items()})
        if c.ppo.old_logprobs == "fused":
            lp_gap = upd["loss/sampler_gap"]  # already a token mean over every host's rows
        else:
            lp_gap = float(_allgather(np.array([lp_gap]))[:, 0].mean())
        rec["rollout/logprob_gap"] = lp_gap
        rec["train/task_cursor"] = self.task_cursor  # global index of this iteration's first task group
        rec["train/hosts"] = self.num_hosts
        rec["advantage/mean"] = float(adv.mean()) if adv.size else 0.0
        rec["advantage/std"] = float(adv.std()) if adv.size else 0.0
        rec["advantage/abs_max"] = float(np.abs(adv).max()) if adv.size else 0.0
        rec["train/rows"] = float(_allgather(np.array([batch.rows]))[:, 0].sum())
        rec["train/response_tokens"] = float(_allgather(np.array([batch.response_mask.sum()]))[:, 0].sum())
        rec["train/prompt_tokens_mean"] = float(batch.attention_mask[:, : batch.prompt_len].sum(1).mean()) if batch.rows else 0.0
        for k, v in (res.stats or {}).items():
            if isinstance(v, (int, float, np.number)):
                rec[f"rollout/{k}"] = float(v)
        timing = {
            "time/rollout_s": t_roll - t_start,
            "time/old_logprobs_s": t_old - t_roll,
            "time/ref_logprobs_s": t_ref - t_old,
            "time/estimator_s": t_est - t_ref,
            "time/update_s": t_upd - t_est,
        }
        for k, v in (res.timing or {}).items():
            timing[f"time/rollout_{k}"] = float(v)
        timing["time/iteration_s"] = t_upd - t_start
        # BiPACE-specific cost: the grouping/advantage kernel (fingerprints are free from the prefill).
        timing["time/bipace_share"] = timing["time/estimator_s"] / max(timing["time/iteration_s"], 1e-9)
        rec.update(timing)

        if self.controller is not None:
            self.epsilon = float(self.controller.update(rec["estimator/singleton_group_rate"]))
        self.task_cursor += c.rollout.num_groups
        self.iteration += 1
        return rec

    def _episode_metrics(self, episodes: list[dict], prefix: str) -> dict[str, float]:
        n = len(episodes)
        sums = np.array([
            n,
            sum(bool(e.get("won")) for e in episodes),
            sum(float(e.get("length", 0)) for e in episodes),
            sum(float(e.get("invalid_count", 0)) for e in episodes),
            sum(bool(e.get("env_error")) for e in episodes),
            sum(float(e.get("return", 0.0)) for e in episodes),
        ], np.float64)
        tot = _allgather(sums).sum(0)
        n, steps = max(tot[0], 1.0), max(tot[2], 1.0)
        return {
            f"{prefix}/success_rate": tot[1] / n,
            f"{prefix}/episode_length": tot[2] / n,
            f"{prefix}/invalid_rate": tot[3] / steps,
            f"{prefix}/env_errors": tot[4],
            f"{prefix}/return": tot[5] / n,
            f"{prefix}/episodes": tot[0],
        }

    # ------------------------------------------------------------------------------------------
    def validate(self) -> dict[str, Any]:
        """Play the fixed validation panel(s) at ``val.temperature``; success overall and per category.

        Categories: every scalar ``task_info`` key of the game among ``depth``, ``task_type``
        (e.g. ``val/success_rate/depth_2``). Held-out goals go under ``val/holdout/``.
        """
        from bipace_jax.rollout import collect

        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        for name, panel in (("val", self.val_panel), ("val/holdout", self.holdout_panel)):
            if not panel:
                continue
            mine = list(range(jax.process_index(), len(panel), self.num_hosts))
            won = np.full((len(panel),), -1.0)
            length = np.full((len(panel),), -1.0)
            if mine:
                key = jax.random.fold_in(jax.random.PRNGKey(self.config.val.seed), 1 + len(name))
                res = collect(self.actor, self.val_sampler, self.pool, self.tokenizer, [panel[i][0] for i in mine],
                              [panel[i][1] for i in mine], self.val_rollout_cfg, key,
                              progress=self.config.log.progress and self.is_primary)
                G = self.config.val.group_size
                eps = list(res.episodes)  # G consecutive episodes per task group, groups in order
                for j, i in enumerate(mine):
                    chunk = eps[j * G:(j + 1) * G]
                    won[i] = np.mean([bool(e.get("won")) for e in chunk])
                    length[i] = np.mean([float(e.get("length", 0)) for e in chunk])
            won = _allgather(won).max(0)
            length = _allgather(length).max(0)
            out[f"{name}/success_rate"] = float(won.mean())
            out[f"{name}/episode_length"] = float(length.mean())
            out[f"{name}/tasks"] = len(panel)
            for key_name in ("depth", "task_type"):
                cats: dict[str, list] = {}
                for (tid, _), w in zip(panel, won):
                    v = self._task_info(tid).get(key_name)
                    if v is not None:
                        cats.setdefault(str(v), []).append(w)
                for v, ws in sorted(cats.items()):
                    out[f"{name}/success_rate/{key_name}_{v}"] = float(np.mean(ws))
                    out[f"{name}/tasks/{key_name}_{v}"] = len(ws)
        out["time/validation_s"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to ``num_iterations`` (validating and checkpointing on schedule); returns a summary.

        Summary: ``first_val`` / ``last_val`` (validation records), ``last_train`` (the last iteration's
        record), ``iterations_run`` in this process's lifetime, ``workdir``.
        """
        from tqdm import tqdm

        c = self.config
        summary: dict[str, Any] = {"workdir": self.workdir, "first_val": None, "last_val": None,
                                   "last_train": None, "iterations_run": 0, "start_iteration": self.iteration}
        pending_val = None
        self._last_checkpoint_s = None
        if c.val.at_start and self.iteration == 0 and c.num_iterations > 0:
            pending_val = self.validate()
            summary["first_val"] = pending_val
        elif self.iteration > 0:  # resumed: the before-RL validation is in the kept metrics
            from bipace_jax.metrics import read_metrics

            first = next((r for r in read_metrics(self.workdir) if r.get("iteration") == 0), {})
            before = {"val/" + k.split("/", 1)[1]: v for k, v in first.items() if k.startswith("val_before/")}
            summary["first_val"] = before or None
        bar = tqdm(total=c.num_iterations, initial=self.iteration, desc="RL iterations",
                   disable=not (c.log.progress and self.is_primary), dynamic_ncols=True)
        try:
            while self.iteration < c.num_iterations:
                rec = self.train_iteration()
                it = self.iteration - 1
                if pending_val is not None:  # the before-training validation goes with iteration 0
                    rec.update({"val_before/" + k.split("/", 1)[1]: x for k, x in pending_val.items()})
                    pending_val = None
                last = self.iteration == c.num_iterations
                if c.val.every and (self.iteration % c.val.every == 0 or last):
                    v = self.validate()
                    rec.update(v)
                    summary["last_val"] = v
                    if summary["first_val"] is None:
                        summary["first_val"] = v
                if self._last_checkpoint_s is not None:
                    rec["time/previous_checkpoint_s"] = self._last_checkpoint_s
                # The line goes first: a kill between line and checkpoint re-runs the iteration, and
                # the re-run replaces the line (MetricsLogger drops lines past the restored step).
                self.metrics.write(it, rec)
                if self.iteration % c.checkpoint.every == 0 or last:
                    t0 = time.perf_counter()
                    self.save_checkpoint()
                    self._last_checkpoint_s = time.perf_counter() - t0
                summary["last_train"] = rec
                summary["iterations_run"] += 1
                bar.update(1)
                bar.set_postfix(success=f"{rec['train/success_rate']:.2f}", it_s=f"{rec['time/iteration_s']:.1f}")
        finally:
            bar.close()
        if self.is_primary:
            if c.log.plots:
                summary["plots"] = make_plots(self.workdir, train_temperature=c.sampler.temperature,
                                              val_temperature=c.val.temperature)
            if c.checkpoint.export_hf:
                summary["hf_export"] = self.export_hf(os.path.join(self.workdir, "hf_final"))
        return summary

    def export_hf(self, path: str) -> str:
        """Write the current policy as a Hugging Face folder (weights, config, tokenizer)."""
        from bipace_jax.models import save_hf_checkpoint

        save_hf_checkpoint(self.actor, path, tokenizer=self.tokenizer)
        return path

    def close(self) -> None:
        self.metrics.close()
        self.checkpointer.close()
        self.pool.close()


def _mean_over_hosts(d: dict[str, float]) -> dict[str, float]:
    if jax.process_count() == 1 or not d:
        return d
    keys = sorted(d)
    vals = _allgather(np.array([d[k] for k in keys], np.float64)).mean(0)
    return dict(zip(keys, map(float, vals)))


def _prompt_lengths(batch: "Batch") -> np.ndarray:
    """int64[N] real prompt tokens of each row (the prompt is left-padded to ``batch.prompt_len``)."""
    return batch.attention_mask[:, : batch.prompt_len].sum(1).astype(np.int64)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    x = np.asarray(x)
    if x.shape[0] == rows:
        return x.copy()
    pad = np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad], 0)


def _pad_cols(x: np.ndarray, cols: int) -> np.ndarray:
    if x.shape[1] >= cols:
        return x[:, :cols]
    return np.concatenate([x, np.zeros((x.shape[0], cols - x.shape[1]), x.dtype)], 1)
