"""A run config (``configs/base.py`` layout) -> ``RunSpec``, and the factories that build from it.

The top of the library's imports: ``build_spec(config)`` runs once, before anything compiles, and
returns a frozen ``RunSpec`` of the library's own dataclasses, one per config section:

=====================  ===========================================================================
config section         ``RunSpec`` field
=====================  ===========================================================================
``model``              ``model``: ``ModelConfig``
``env``                ``env``: ``config.EnvConfig``
``tasks``              ``tasks``: ``config.TasksConfig``
``sampler``            ``sampler``: ``sampling.SamplerConfig`` (``val_sampler`` at ``val.temperature``)
``rollout``            ``rollout``: ``rollout.RolloutConfig`` (``val_rollout`` at ``val.group_size``),
                       ``num_groups``
``estimator``          ``estimator``: ``EstimatorConfig``; ``calibration``; ``controller``
``ppo``                ``loss``: ``losses.PPOLossConfig``; ``learner``: ``config.LearnerConfig``
``optim``              ``optim``: ``config.OptimConfig``
``val``                ``val``: ``config.ValConfig``
``checkpoint`` ...     ``checkpoint``, ``log``, ``mesh``
=====================  ===========================================================================

Every field is checked once, in its dataclass (``__post_init__``) or here for what spans sections;
the library dataclasses name their fields ``SamplerConfig.top_p`` and the like, and since each
mirrors its section one to one, the error says ``config.sampler.top_p``. A field a dataclass takes
from another section (``RolloutConfig.game`` = ``env.name``) is checked in its own section first.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from flax import nnx

import environments
from bipace_jax import losses, runfolder
from bipace_jax import plan as plan_lib
from bipace_jax.config import (
    AsyncConfig,
    CalibrationConfig,
    CheckpointConfig,
    ConfigError,
    EnvConfig,
    LearnerConfig,
    LogConfig,
    MeshConfig,
    OldLogprobs,
    OptimConfig,
    Schedule,
    Switch,
    TasksConfig,
    ValConfig,
    check_choice,
    check_int,
    check_str,
    decode,
    fail,
    get,
    resolve_path,
    resolve_template,
    system_prompt_of,
)
from bipace_jax.estimators import EpsilonController, EstimatorConfig
from bipace_jax.learner import make_optimizer
from bipace_jax.models import Qwen2Actor, Qwen2Config, load_hf_checkpoint, load_tokenizer
from bipace_jax.models.config import DType, MatmulPrecision, Remat
from bipace_jax.ppo import PPOLearner
from bipace_jax.rollout import RolloutConfig, Scheduler
from bipace_jax.sampling import SamplerConfig
from bipace_jax.tiny import tiny_actor_config

#: ``model.remat``'s value the run plan resolves (``plan.resolve_remat``).
REMAT_AUTO = "auto"

__all__ = [
    "ModelConfig",
    "RunSpec",
    "actor_architecture",
    "build_actor",
    "build_spec",
    "resolved_remat",
    "checked",
    "estimator_config",
    "init_actor",
    "load_model_tokenizer",
    "loss_config",
    "make_optimizer",
    "ppo_learner",
    "rollout_config",
    "sampler_config",
    "stop_token_ids",
    "validate",
]


def checked(section: str, cls: type, **fields):
    """``cls(**fields)`` for a library dataclass that mirrors config section ``section``; its
    ``ValueError`` re-raised as a ``ConfigError`` under the config's name (``SamplerConfig.top_p`` is
    ``config.sampler.top_p``)."""
    try:
        return cls(**fields)
    except (ValueError, TypeError) as e:
        msg = str(e).replace(f"{cls.__name__}.", f"config.{section}.")
        raise ConfigError(msg if msg.startswith("config.") else f"config.{section}: {msg}") from None


# ------------------------------------------------------------------------------------------------
# The model section.


#: A Hugging Face hub id ("Qwen/Qwen2.5-7B-Instruct"): owner/name, no other slash, no leading dot.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _folder_has(field: str, folder: str, name: str = "") -> bool:
    """Whether ``folder`` (a local path or a ``gs://`` URL) is a folder, or holds the file ``name``.

    Raises:
      ConfigError: naming ``field``: a URL of another scheme than gs://, a gs:// folder without the
        ``[gcp]`` packages (naming the extra), or a gs:// folder that cannot be read (the cause's first line).
    """
    if not runfolder.is_remote(folder):
        return os.path.isfile(os.path.join(folder, name)) if name else os.path.isdir(folder)
    expected = "a local or gs:// folder"
    try:
        p = runfolder.path(folder, f"config.{field}")
    except runfolder.RunFolderError:
        fail(field, f"be {expected} (unsupported scheme)", folder)
    if message := runfolder.missing_extra(folder, f"config.{field}", expected):
        raise ConfigError(message)
    try:
        return (p / name).is_file() if name else p.is_dir()
    except Exception as e:  # noqa: BLE001 (auth, permission and network errors differ by backend)
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        fail(field, f"be a readable {expected} ({type(e).__name__}: {detail})", folder)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``config.model``: the actor (loaded from ``checkpoint``, else a random ``preset`` init).

    Attributes:
      checkpoint: Hugging Face folder (resolved, ``config.resolve_path``), local or ``gs://`` (read from
        a local copy made once per process, ``runfolder.local_folder``); "" = random init.
      tokenizer: tokenizer folder (resolved), local or ``gs://``; "" = the checkpoint's (or the
        project's game BPE).
      preset: a ``Qwen2Config.preset`` name; "tiny" takes the sizes below.
      hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the tiny preset's sizes.
      vocab_size: size of the BPE the project trains when no tokenizer is given (>= 300).
      fingerprint_layer: HF ``hidden_states`` index of the BiPACE fingerprint.
      dtype, param_dtype: ``models.config.DType`` of activations and parameters.
      matmul_precision: a ``models.config.MatmulPrecision``.
      remat: a ``models.config.Remat``, or ``"auto"``: the run plan picks one from the update's estimated
        memory per chip and the chips' HBM (``plan.resolve_remat``; set on the actor by `ppo_learner`).
      scan_layers: one ``lax.scan`` over the decoder layers.
    """

    checkpoint: str = ""
    tokenizer: str = ""
    preset: str = "tiny"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    fingerprint_layer: int = -1
    dtype: DType = DType.FLOAT32
    param_dtype: DType = DType.FLOAT32
    matmul_precision: MatmulPrecision = MatmulPrecision.DEFAULT
    remat: Remat | str = Remat.NONE
    scan_layers: bool = False

    def __post_init__(self):
        check_str("model.checkpoint", self.checkpoint, "a path string ('' = random init)")
        check_str("model.tokenizer", self.tokenizer, "a path string ('' = the checkpoint's)")
        try:
            Qwen2Config.preset(self.preset)
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"config.model.preset must name a Qwen2Config preset ({e})") from None
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            check_int(f"model.{f}", getattr(self, f), 1)
        check_int("model.vocab_size", self.vocab_size, 300)
        if self.num_heads % self.num_kv_heads:
            fail("model.num_heads", f"be a multiple of model.num_kv_heads={self.num_kv_heads}", self.num_heads)
        if self.hidden_size % self.num_heads:
            fail("model.hidden_size", f"be a multiple of model.num_heads={self.num_heads}", self.hidden_size)
        check_int("model.fingerprint_layer", self.fingerprint_layer)
        object.__setattr__(self, "dtype", decode("model.dtype", DType, self.dtype))
        object.__setattr__(self, "param_dtype", decode("model.param_dtype", DType, self.param_dtype))
        precision = decode("model.matmul_precision", MatmulPrecision, self.matmul_precision)
        object.__setattr__(self, "matmul_precision", precision)
        if self.remat != REMAT_AUTO:
            if self.remat not in [r.value for r in Remat]:
                fail("model.remat", f"be one of {[r.value for r in Remat] + [REMAT_AUTO]}", self.remat)
            object.__setattr__(self, "remat", Remat(self.remat))
        check_choice("model.scan_layers", self.scan_layers, (True, False))
        if self.tokenizer and not _folder_has("model.tokenizer", resolve_path(self.tokenizer)):
            fail("model.tokenizer", "be an existing tokenizer folder", self.tokenizer)

    @classmethod
    def from_config(
        cls, c: ml_collections.ConfigDict, *, abstract: bool = False, fields: Sequence[str] | None = None
    ) -> ModelConfig:
        """``ModelConfig`` of ``c.model`` with its paths resolved; unless ``abstract`` (shapes only,
        ``launch.aot``), the checkpoint must be an HF folder, and non-tiny presets need one. With
        ``fields``, only those are read (the warm start's config names the tiny sizes and tokenizer
        only); the others keep their defaults."""
        names = tuple(fields) if fields is not None else tuple(f.name for f in dataclasses.fields(cls))
        m = cls(**{name: get(c, f"model.{name}") for name in names})
        if m.checkpoint and not abstract:
            if not _folder_has("model.checkpoint", resolve_path(m.checkpoint), "config.json"):
                if _HUB_ID.fullmatch(m.checkpoint) and not os.path.exists(resolve_path(m.checkpoint)):
                    # nothing downloads at run time: say how to fetch the folder once
                    fail(
                        "model.checkpoint",
                        f"be a local or gs:// Hugging Face folder, not a hub id (download it once: "
                        f"hf download {m.checkpoint} --local-dir /ckpt/{m.checkpoint.split('/')[1]}, "
                        f"then --config.model.checkpoint=/ckpt/{m.checkpoint.split('/')[1]})",
                        m.checkpoint,
                    )
                exists = _folder_has("model.checkpoint", resolve_path(m.checkpoint))
                fail(
                    "model.checkpoint",
                    f"be a Hugging Face folder holding config.json ({'it has none' if exists else 'no such folder'}; "
                    "e.g. a run's hf_final/ or a downloaded model; --config.model.checkpoint= for a random tiny init)",
                    m.checkpoint,
                )
        elif m.preset != "tiny" and not abstract:
            fail(
                "model.checkpoint",
                f"point at a Hugging Face {m.preset} folder (a {m.preset} random init trains nothing useful)",
                m.checkpoint,
            )
        return dataclasses.replace(m, checkpoint=resolve_path(m.checkpoint), tokenizer=resolve_path(m.tokenizer))


# ------------------------------------------------------------------------------------------------
# The run spec.


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The whole run, decoded and checked (``build_spec``). Fields as in the module table; besides:

    Attributes:
      seed: model init, task order, rollout keys, mini-batch shuffles.
      num_iterations: RL iterations of the run.
      compile_cache_dir: JAX's persistent compilation cache folder ("" = off, "auto" = a user cache dir
        on accelerators, off on CPU: ``config.compile_cache_folder``).
      num_groups: task groups per iteration over all hosts (``config.rollout.num_groups``).
      controller: the online epsilon controller's initial state (None: off or a non-clustering
        estimator); ``new_controller()`` copies it.
      config: the checked source config (a ``FrozenConfigDict``), written to the run folder as ``config.json``.
    """

    seed: int
    num_iterations: int
    compile_cache_dir: str
    model: ModelConfig
    env: EnvConfig
    tasks: TasksConfig
    sampler: SamplerConfig
    val_sampler: SamplerConfig
    rollout: RolloutConfig
    val_rollout: RolloutConfig
    num_groups: int
    estimator: EstimatorConfig
    calibration: CalibrationConfig
    controller: EpsilonController | None
    loss: losses.PPOLossConfig
    learner: LearnerConfig
    optim: OptimConfig
    val: ValConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    mesh: MeshConfig
    config: ml_collections.FrozenConfigDict = dataclasses.field(repr=False, compare=False)
    async_rl: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)

    def estimator_at(self, epsilon: float) -> EstimatorConfig:
        """``estimator`` with a calibrated or controlled ``epsilon``."""
        return dataclasses.replace(self.estimator, epsilon=epsilon)

    def new_controller(self) -> EpsilonController | None:
        """A fresh copy of ``controller`` (it moves during the run)."""
        return copy.deepcopy(self.controller)

    @property
    def needs_calibration(self) -> bool:
        """Whether epsilon is calibrated on the first iteration (clustering estimators only)."""
        return self.calibration.enabled and self.estimator.clusters


def _rl_optim(c: ml_collections.ConfigDict) -> OptimConfig:
    """``OptimConfig`` of ``c.optim`` for RL: a ``constant`` schedule (RL's optimizer steps per iteration
    follow its batches, so no decay can end at the last one).

    Raises:
      ConfigError: naming ``config.optim.schedule``.
    """
    optim = OptimConfig.from_config(c)
    if optim.schedule is not Schedule.CONSTANT:
        fail(
            "optim.schedule",
            "be 'constant' for RL (its number of optimizer steps is not known in advance)",
            optim.schedule.value,
        )
    return optim


def build_spec(config: ml_collections.ConfigDict, num_devices: int | None = None, *, abstract: bool = False) -> RunSpec:
    """Check every field of a run config and decode it into a ``RunSpec``; runs on the host, before
    anything compiles, touching no device.

    Args:
      config: the config (``configs/base.py`` layout).
      num_devices: when given, the mesh must fit this many devices exactly.
      abstract: the config is only compiled from shapes (``launch.aot``): no checkpoint is needed.

    Raises:
      ConfigError: naming the first bad field, ``config.<section>.<field>``, and the expected value.
    """
    c = config
    seed = check_int("seed", get(c, "seed"), 0)
    iterations = check_int("num_iterations", get(c, "num_iterations"), 0)
    cache = check_str(
        "compile_cache_dir",
        get(c, "compile_cache_dir"),
        "a folder path string ('' = no persistent compilation cache, 'auto' = the user cache dir on accelerators)",
    )
    model = ModelConfig.from_config(c, abstract=abstract)
    env = EnvConfig.from_config(c)
    check_choice("env.name", env.name, environments.registered())
    tasks = TasksConfig.from_config(c)
    num_groups = check_int("rollout.num_groups", get(c, "rollout.num_groups"), 1)
    for f in ("system_prompt", "template", "fallback_action"):
        check_str(f"rollout.{f}", get(c, f"rollout.{f}"))
    resolve_template(c.rollout.template)  # checked here, before the samplers
    sampler = sampler_config(c)
    estimator = estimator_config(c)
    rollout = rollout_config(c, group_size=c.rollout.group_size)
    if sampler.length_buckets[-1] < rollout.max_prompt_length:
        fail(
            "sampler.length_buckets",
            f"reach rollout.max_prompt_length={rollout.max_prompt_length}",
            sampler.length_buckets,
        )
    calibration = CalibrationConfig.from_config(c)
    controller = None
    if check_choice("estimator.controller.enabled", get(c, "estimator.controller.enabled"), (True, False)):
        fields = {k: v for k, v in c.estimator.controller.to_dict().items() if k != "enabled"}
        controller = checked("estimator.controller", EpsilonController, epsilon=estimator.epsilon, **fields)
    loss = loss_config(c)
    learner = LearnerConfig.from_config(c)
    LearnerConfig.check_tis_cap(learner.old_logprobs, loss.tis_cap)
    if learner.old_logprobs is OldLogprobs.SAMPLER and (sampler.top_p != 1.0 or sampler.top_k):
        # The sampler's log-probs are log_softmax(logits / T) before truncation: the policy PPO trains
        # at the rollout temperature T, but not the top-p/top-k-truncated one that played.
        fail("ppo.old_logprobs", "be 'recompute' unless the sampler is untruncated (top_p 1, top_k 0)", "sampler")
    longest = rollout.max_prompt_length + sampler.max_new_tokens  # a row's most tokens: one line must hold it
    if learner.pack and 0 < learner.pack_width < longest:
        fail(
            "ppo.pack_width",
            f"be 0 or >= rollout.max_prompt_length + sampler.max_new_tokens = {longest}",
            learner.pack_width,
        )
    if learner.pack and 0 < learner.pack_response_width < sampler.max_new_tokens:
        fail(
            "ppo.pack_response_width",
            f"be 0 or >= sampler.max_new_tokens = {sampler.max_new_tokens}",
            learner.pack_response_width,
        )
    val = ValConfig.from_config(c)
    val_sampler = dataclasses.replace(sampler, temperature=val.temperature)
    mesh = MeshConfig.from_config(c)
    if num_devices is not None:
        mesh.check_devices(num_devices)
    async_rl = AsyncConfig.of(c)
    if async_rl.switch is not Switch.GAME and async_rl.disaggregated and rollout.scheduler != Scheduler.LOCKSTEP:
        fail("async_rl.switch", f"be 'game' with rollout.scheduler={rollout.scheduler.value!r}", "turn")
    return RunSpec(
        seed=seed,
        num_iterations=iterations,
        compile_cache_dir=cache,
        model=model,
        env=env,
        tasks=tasks,
        sampler=sampler,
        val_sampler=val_sampler,
        rollout=rollout,
        val_rollout=dataclasses.replace(rollout, group_size=val.group_size, branch_turns=()),  # validation: lone games
        num_groups=num_groups,
        estimator=estimator,
        calibration=calibration,
        controller=controller if estimator.clusters else None,  # epsilon tunes the clustering only
        loss=loss,
        learner=learner,
        optim=_rl_optim(c),
        val=val,
        checkpoint=CheckpointConfig.from_config(c),
        log=LogConfig.from_config(c),
        mesh=mesh,
        config=ml_collections.FrozenConfigDict(c),
        async_rl=async_rl,
    )


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, *, abstract: bool = False) -> None:
    """``build_spec`` for its checks only (the spec is dropped); raises ``ConfigError``."""
    build_spec(c, num_devices, abstract=abstract)


# ------------------------------------------------------------------------------------------------
# Sections -> library dataclasses (the only place a config field is mapped onto a library field).


def sampler_config(
    c: ml_collections.ConfigDict, *, temperature: float | None = None, eos_token_ids: tuple[int, ...] | None = None
) -> SamplerConfig:
    """``SamplerConfig`` of ``c.sampler`` (``temperature`` overrides it, e.g. ``val.temperature``)."""
    s = c.sampler
    return checked(
        "sampler",
        SamplerConfig,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature if temperature is None else temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        greedy=False,
        stop_strings=tuple(s.stop_strings),
        batch_buckets=tuple(s.batch_buckets),
        length_buckets=tuple(s.length_buckets),
        eos_token_ids=eos_token_ids,
        shared_head_tokens=s.shared_head_tokens,
    )


def rollout_config(c: ml_collections.ConfigDict, *, group_size: int) -> RolloutConfig:
    """``RolloutConfig`` of ``c.rollout`` with the game and step cap of ``c.env`` and the PACE key of
    ``c.estimator`` (check those sections first: their errors then name their own fields);
    ``group_size`` is ``rollout.group_size`` for training, ``val.group_size`` for validation."""
    r = c.rollout
    return checked(
        "rollout",
        RolloutConfig,
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
        similarity_thresh=c.estimator.similarity_thresh,
        show_inventory=r.show_inventory,
        system_prompt=system_prompt_of(r.system_prompt),
        template=resolve_template(r.template),
        fallback_action=r.fallback_action or None,  # "" = the game's own (GameSpec.fallback_action)
        scheduler=r.scheduler,
        num_slots=r.num_slots,
        chunk_steps=r.chunk_steps,
        branch_turns=tuple(r.get("branch_turns", ())),
        branch_children=r.get("branch_children", 2),
    )


def loss_config(c: ml_collections.ConfigDict) -> losses.PPOLossConfig:
    """``PPOLossConfig`` of ``c.ppo``; the trained policy is the one that played, softmax(logits / rollout
    temperature), as in verl (check ``c.sampler`` first)."""
    p = c.ppo
    return checked(
        "ppo",
        losses.PPOLossConfig,
        clip_eps=p.clip_eps,
        dual_clip=p.dual_clip or None,
        kl_coef=p.kl_coef,
        entropy_coef=p.entropy_coef,
        kl_bound=p.kl_bound,
        temperature=c.sampler.temperature,
        tis_cap=get(c, "ppo.tis_cap"),
    )


def estimator_config(c: ml_collections.ConfigDict, epsilon: float | None = None) -> EstimatorConfig:
    """``EstimatorConfig`` of ``c.estimator``; ``epsilon`` overrides it (calibrated or controlled)."""
    e = c.estimator
    return checked(
        "estimator",
        EstimatorConfig,
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
        similarity_thresh=e.similarity_thresh,
        hgpo_history=e.hgpo_history,
        hgpo_alpha=e.hgpo_alpha,
        hgpo_base_group=e.hgpo_base_group,
    )


# ------------------------------------------------------------------------------------------------
# Factories: the actor, its learner, the stop ids.


def stop_token_ids(eos_token_ids: Sequence[int], tokenizer: Any, checkpoint: str = "") -> tuple[int, ...]:
    """The ids a response stops on: the union, in first-seen order, of the model config's
    ``eos_token_ids`` (config.json), the checkpoint folder's ``generation_config.json`` ``eos_token_id``
    (when ``checkpoint`` is a folder holding one; a ``gs://`` folder is read from its local copy,
    ``runfolder.local_folder``) and the tokenizer's EOS token.

    Qwen2.5-Instruct's config.json names ``<|endoftext|>`` (151643) while the chat turn ends with
    ``<|im_end|>`` (151645), which generation_config.json and the tokenizer add.
    """
    ids = [int(i) for i in eos_token_ids]
    local = runfolder.local_folder(checkpoint) if checkpoint else ""
    if local and os.path.isfile(os.path.join(local, "generation_config.json")):
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(local).eos_token_id
        ids += [int(i) for i in (gen if isinstance(gen, (list, tuple)) else [gen]) if i is not None]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def build_actor(model: ModelConfig, tokenizer: Any, mesh: Any = None, *, seed: int = 0) -> Qwen2Actor:
    """The actor of ``model`` (``RunSpec.model``): loaded from ``checkpoint``, or a random ``preset`` init.

    A random tiny init takes its sizes from ``model`` and its vocabulary and EOS from the tokenizer;
    parameters are drawn from ``nnx.Rngs(seed)``. ``mesh``: a checkpoint's tensors load straight into
    their ``NamedSharding`` on it (each device reads only its shard; see ``load_hf_checkpoint``);
    None: onto the default device. A ``gs://`` checkpoint is read from its local copy, made once per
    process (``runfolder.local_folder``).
    """
    m = model
    if m.checkpoint:
        # param_dtype too: bf16 parameters would make AdamW's small updates round away
        actor = load_hf_checkpoint(
            runfolder.local_folder(resolve_path(m.checkpoint)),
            mesh=mesh,
            dtype=DType(m.dtype).jnp,
            param_dtype=DType(m.param_dtype).jnp,
            fingerprint_layer=m.fingerprint_layer,
        )
        actor.matmul_precision, actor.remat, actor.scan_layers = m.matmul_precision, _actor_remat(m), m.scan_layers
        return actor
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if m.preset == "tiny" else None
    return init_actor(m, actor_architecture(m, len(tokenizer), eos), seed=seed)


def load_model_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of ``model`` (``RunSpec.model``): its ``tokenizer`` folder, else its ``checkpoint``'s
    (``models.load_tokenizer``; a ``gs://`` folder is read from its local copy, ``runfolder.local_folder``).

    Raises:
      ValueError: ``model`` names neither folder, or the folder holds no loadable tokenizer.
    """
    folder = model.tokenizer or model.checkpoint
    if not folder:
        raise ValueError("load_model_tokenizer: model.tokenizer and model.checkpoint are both ''")
    return load_tokenizer(runfolder.local_folder(resolve_path(folder)))


def actor_architecture(
    model: ModelConfig, vocab_size: int, eos_token_id: int | None = None, *, max_position_embeddings: int = 8192
) -> Qwen2Config:
    """The ``Qwen2Config`` of a random init of ``model``: the named ``preset``, or for "tiny" the sizes
    of ``model`` with ``vocab_size``, ``eos_token_id`` (None: ``Qwen2Config.tiny``'s) and
    ``max_position_embeddings`` (written to an exported config.json only: RoPE has no table)."""
    m = model
    if m.preset != "tiny":
        return Qwen2Config.preset(m.preset)
    sizes = dict(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers)
    heads = dict(num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads)
    positions = {"max_position_embeddings": max_position_embeddings}
    return tiny_actor_config(vocab_size, eos_token_id=eos_token_id, **positions, **sizes, **heads)


def init_actor(model: ModelConfig, cfg: Qwen2Config, *, seed: int = 0) -> Qwen2Actor:
    """A ``Qwen2Actor`` of architecture ``cfg`` with ``model``'s fingerprint layer, dtypes, matmul
    precision, remat policy and layer scan; parameters drawn from ``nnx.Rngs(seed)`` (under
    ``nnx.eval_shape``: shapes only)."""
    m = model
    return Qwen2Actor(
        cfg,
        fingerprint_layer=m.fingerprint_layer,
        dtype=DType(m.dtype).jnp,
        param_dtype=DType(m.param_dtype).jnp,
        rngs=nnx.Rngs(seed),
        matmul_precision=m.matmul_precision,
        remat=_actor_remat(m),
        scan_layers=m.scan_layers,
    )


def _actor_remat(m: ModelConfig) -> Remat:
    # "auto" needs the run plan: until `ppo_learner` resolves it, the actor holds the least-memory policy
    return Remat.FULL if m.remat == REMAT_AUTO else m.remat


def resolved_remat(spec: RunSpec, mesh, local_mesh) -> str:
    """``model.remat="auto"`` as the run plan resolves it for training on ``mesh`` (its hosts, axes and
    first chip's HBM, ``plan.device_hbm_bytes``) with ``local_mesh`` (None: ``mesh``) sampling: the
    ``RunPlan.remat`` the trainer's summary shows."""
    devices = list(mesh.devices.flat)
    hosts = len({d.process_index for d in devices})
    tensor = (local_mesh or mesh).shape["tensor"]
    shape = (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"])
    layout = plan_lib.HostLayout(hosts, len(devices), len(devices) // hosts, *shape, tensor)
    mine = [d for d in devices if d.process_index == jax.process_index()] or devices  # this process can ask
    return plan_lib.plan(spec, layout, hbm_bytes=plan_lib.device_hbm_bytes(mine[0])).remat


def ppo_learner(spec: RunSpec, actor: Qwen2Actor, mesh, local_mesh, *, support: int) -> PPOLearner:
    """The ``PPOLearner`` of ``spec.learner`` (batching, old log-probs), ``spec.loss``, ``spec.optim``
    and the sampler's length buckets; ``support``: the tokenizer's size (ids the sampler can draw).
    With ``model.remat="auto"`` it first sets ``actor.remat`` to the run plan's policy on ``mesh``
    (and ``local_mesh``'s tensor size) and its chips' HBM (``plan.resolve_remat``)."""
    p = spec.learner
    if spec.model.remat == REMAT_AUTO:
        actor.remat = resolved_remat(spec, mesh, local_mesh)
    return PPOLearner(
        actor,
        mesh,
        spec.loss,
        make_optimizer(spec.optim),
        local_mesh=local_mesh,
        epochs=p.epochs,
        micro_batch_rows=p.micro_batch_rows,
        mini_batch_rows=p.mini_batch_rows,
        fused_old_logprobs=p.old_logprobs is OldLogprobs.FUSED,
        prompt_buckets=spec.sampler.length_buckets,
        support=min(support, actor.config.vocab_size),
        logprob_chunk=p.logprob_chunk,
        pack=p.pack,
        pack_width=p.pack_width,
        pack_response_width=p.pack_response_width,
    )
