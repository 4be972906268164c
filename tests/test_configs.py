"""Run configs: every setting loads and validates; command-line overrides; one-line field errors."""

import glob
import importlib
import json
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

import configs
from bipace_jax.build import estimator_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_run_config(path):
    """A training-run setting: a config file built on configs/base.py (not SFT or helper modules)."""
    with open(path) as f:
        text = f.read()
    return "from configs import base" in text or "from configs import _paper" in text


SETTINGS = sorted(
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not os.path.basename(p).startswith("_") and (_is_run_config(p) or p.endswith("base.py"))
)


def _load(name):
    c = importlib.import_module(f"configs.{name}").get_config()
    if name == "textcraft_tiny":  # the shipped warm start may be absent in a checkout: random init
        c.model.checkpoint = ""
    return c


@pytest.fixture
def hf_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(tmp_path)


def test_every_setting_file_validates(hf_folder):
    assert {
        "base",
        "textcraft_tiny",
        "alfworld_qwen2_5_1_5b",
        "alfworld_qwen2_5_7b",
        "textcraft_qwen2_5_1_5b",
        "textcraft_qwen2_5_7b",
        "webshop_qwen2_5_1_5b",
        "webshop_qwen2_5_7b",
    } <= set(SETTINGS)
    for name in SETTINGS:
        c = _load(name)
        if c.model.preset != "tiny":
            c.model.checkpoint = hf_folder
        configs.validate(c)


@pytest.mark.parametrize(
    "game,size,layer,eps,steps,norm",
    [
        ("alfworld", "qwen2_5_1_5b", -12, 0.05, 50, "mean_std"),
        ("alfworld", "qwen2_5_7b", -8, 0.10, 50, "mean_std"),
        ("webshop", "qwen2_5_1_5b", -12, 0.05, 15, "mean"),
        ("webshop", "qwen2_5_7b", -8, 0.10, 15, "mean"),
        ("textcraft", "qwen2_5_7b", -8, 0.10, 50, "mean_std"),
    ],
)
def test_paper_settings_carry_the_paper_values(game, size, layer, eps, steps, norm):
    c = _load(f"{game}_{size}")
    assert (c.env.name, c.model.fingerprint_layer, c.estimator.epsilon, c.env.max_steps, c.estimator.norm) == (
        game,
        layer,
        eps,
        steps,
        norm,
    )
    assert (c.rollout.num_groups, c.rollout.group_size, c.estimator.gamma, c.estimator.omega) == (16, 8, 0.95, 1.0)
    assert (c.optim.learning_rate, c.ppo.kl_coef, c.ppo.entropy_coef, c.ppo.clip_eps, c.ppo.dual_clip) == (
        1e-6,
        0.01,
        0.001,
        0.2,
        3.0,
    )
    assert (
        c.sampler.temperature,
        c.val.temperature,
        c.rollout.history_length,
        c.rollout.invalid_penalty,
        c.num_iterations,
        c.estimator.name,
    ) == (1.0, 0.4, 2, 0.1, 150, "bipace_q")
    # memory at 2048 + 512 tokens (launch.aot): full remat, scanned layers, 128-position LM-head chunks
    assert (c.model.remat, c.model.scan_layers, c.ppo.logprob_chunk) == ("full", True, 128)
    assert c.ppo.micro_batch_rows == (8 if size == "qwen2_5_1_5b" else 4)
    # verl-agent's ppo_mini_batch_size: one AdamW step per 256 (ALFWorld, TextCraft) / 64 (WebShop) step rows
    assert c.ppo.mini_batch_rows == (64 if game == "webshop" else 256) and c.ppo.epochs == 1
    # verl-agent's validity rule (think and no CJK) and projection of invalid responses
    r = c.rollout
    assert (r.require_think, r.reject_cjk, r.invalid_action) == (True, True, "projected")
    assert r.projection_chars == (20 if game == "webshop" else 30)
    # Protocol options: verl-agent's GiGPO statistics, the paper's PACE (step std only where GiGPO divides).
    e = c.estimator
    assert (e.penalty, e.episode_stats, e.pace_fallback) == ("own_row", "rows", "singleton_pool")
    assert e.step_norm == ("std" if norm == "mean_std" else "none")
    ecfg = estimator_config(c)
    assert (ecfg.penalty, ecfg.episode_stats, ecfg.step_norm, ecfg.pace_fallback) == (
        e.penalty,
        e.episode_stats,
        e.step_norm,
        e.pace_fallback,
    )


def test_tiny_cpu_config_keeps_the_protocol_defaults():
    e = _load("textcraft_tiny").estimator
    assert (e.penalty, e.episode_stats, e.step_norm, e.pace_fallback) == (
        "in_reward",
        "trajectory",
        "none",
        "same_key_cluster",
    )


def test_command_line_overrides_reach_nested_fields():
    argv = [
        "prog",
        f"--config={ROOT}/configs/alfworld_qwen2_5_7b.py",
        "--config.estimator.epsilon=0.1",
        "--config.seed=2",
        "--config.rollout.num_groups=4",
        "--config.tasks.train=depth=2,3",
    ]
    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
    fv(argv)
    c = holder.value
    assert (c.estimator.epsilon, c.seed, c.rollout.num_groups, c.tasks.train) == (0.1, 2, 4, "depth=2,3")
    with pytest.raises(AttributeError, match="epsilonn"):  # a misspelt field is refused, not silently added
        argv = ["prog", f"--config={ROOT}/configs/base.py", "--config.estimator.epsilonn=0.1"]
        fv2 = flags.FlagValues()
        config_flags.DEFINE_config_file("config", flag_values=fv2, sys_argv=argv)
        fv2(argv)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("estimator.epsilon", 1.5, "config.estimator.epsilon: expected a value in [0, 1), got 1.5"),
        ("estimator.name", "gipgo", "config.estimator.name: expected one of"),
        ("estimator.gamma", -0.1, "config.estimator.gamma"),
        ("estimator.step_norm", "mad", "config.estimator.step_norm: expected one of ('none', 'std'), got 'mad'"),
        ("estimator.pace_fallback", "loo", "config.estimator.pace_fallback: expected one of"),
        ("estimator.episode_stats", "steps", "config.estimator.episode_stats: expected one of"),
        (
            "estimator.penalty",
            "own_row",
            "config.estimator.penalty: 'own_row' requires config.estimator.episode_stats='rows', got",
        ),
        ("rollout.group_size", 0, "config.rollout.group_size must be an int >= 1, got 0"),
        ("rollout.reset_retries", -1, "config.rollout.reset_retries must be an int >= 0, got -1"),
        ("rollout.invalid_action", "skip", "config.rollout.invalid_action must be one of ('fallback', 'projected')"),
        ("rollout.projection_chars", 0, "config.rollout.projection_chars must be an int >= 1, got 0"),
        ("rollout.scheduler", "eager", "config.rollout.scheduler must be one of ('lockstep', 'continuous')"),
        ("rollout.chunk_steps", 0, "config.rollout.chunk_steps must be an int >= 1, got 0"),
        (
            "model.matmul_precision",
            "tf32",
            "config.model.matmul_precision must be one of ['default', 'high', 'highest'], got 'tf32'",
        ),
        ("model.remat", "dots", "config.model.remat must be one of ['none', 'full', 'save_dots', 'auto'], got 'dots'"),
        ("ppo.logprob_chunk", -1, "config.ppo.logprob_chunk must be an int >= 0, got -1"),
        ("ppo.dual_clip", 0.5, "config.ppo.dual_clip must be > 1 (None or, in a run config, 0 = off), got 0.5"),
        ("ppo.mini_batch_rows", 10, "config.ppo.mini_batch_rows must be a multiple of ppo.micro_batch_rows"),
        ("ppo.old_logprobs", "sampler", "config.ppo.old_logprobs must be 'recompute' unless"),
        ("ppo.epochs", 2, "config.ppo.old_logprobs must not be 'fused' unless ppo.epochs == 1"),
        (
            "ppo.pack_width",
            479,
            "config.ppo.pack_width must be 0 or >= rollout.max_prompt_length + sampler.max_new_tokens = 480, got 479",
        ),
        ("ppo.pack_response_width", 31, "config.ppo.pack_response_width must be 0 or >= sampler.max_new_tokens = 32"),
        ("val.temperature", 0.0, "config.val.temperature"),
        (
            "estimator.calibration",
            {"enabled": True, "target_singleton_rate": 0.25, "grid": (0.1, 0.05)},
            "config.estimator.calibration.grid must be a non-empty, strictly ascending tuple",
        ),
        ("tasks.train", "depth>2", "config.tasks.train must be a task selector"),
        ("env.name", "minecraft", "config.env.name must be one of"),
        (
            "model.checkpoint",
            "/nonexistent/ckpt",
            "config.model.checkpoint must be a Hugging Face folder holding config.json (no such folder; e.g. a "
            "run's hf_final/ or a downloaded model",
        ),
        ("mesh.data", 0, "config.mesh.data must be an int >= 1 or -1"),
        ("val.panel", "grid", "config.val.panel must be one of ['spread', 'random'], got 'grid'"),
        ("ppo.old_logprobs", "cached", "config.ppo.old_logprobs must be one of ['recompute', 'sampler', 'fused']"),
        ("model.dtype", "float16", "config.model.dtype must be one of ['float32', 'bfloat16'], got 'float16'"),
        ("checkpoint.keep", 0, "config.checkpoint.keep must be an int >= 1, got 0"),
        ("val.seed", 5, "config.val.seed must be an int >= 1000000, got 5"),
        ("env.timeout_s", 0.0, "config.env.timeout_s must be a number in (0, inf], got 0.0"),
        ("optim.b2", 1.0, "config.optim.b2 must be a number in [0, 1), got 1.0"),
        ("tasks.holdout_every", -1, "config.tasks.holdout_every must be an int >= 0, got -1"),
        ("sampler.top_p", 0.0, "config.sampler.top_p must lie in (0, 1], got 0.0"),
        ("env.max_steps", 0, "config.env.max_steps must be an int >= 1, got 0"),
        ("log.wandb_project", "", "config.log.wandb_project must be a non-empty wandb project name"),
        ("log.transcripts_every", -1, "config.log.transcripts_every must be an int >= 0, got -1"),
        ("log.transcripts_max_games", 0, "config.log.transcripts_max_games must be an int >= 1, got 0"),
        (
            "sampler.length_buckets",
            (512, 256),
            "config.sampler.length_buckets must be a non-empty strictly ascending tuple",
        ),
    ],
)
def test_bad_field_fails_with_one_line_naming_it(field, value, message):
    c = _load("textcraft_tiny")
    if field == "ppo.old_logprobs" and value == "sampler":
        c.sampler.top_p = 0.9  # a tempered sampler is fine (PPO trains the tempered policy); a truncated one is not
    if field == "ppo.epochs":
        c.ppo.old_logprobs, c.ppo.mini_batch_rows = "fused", 0
    if field.startswith("ppo.pack_"):
        c.ppo.pack = True  # the widths are checked when packing is on
    section, name = field.split(".")
    with c.unlocked():
        c[section][name] = value
    with pytest.raises(configs.ConfigError) as e:
        configs.validate(c)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mesh_must_fit_the_device_count():
    c = _load("base")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    configs.validate(c, num_devices=8)
    assert configs.mesh_shape(c, 8) == (2, 2, 2)
    with pytest.raises(configs.ConfigError, match="config.mesh must fit the 4 devices"):
        configs.validate(c, num_devices=4)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 4
    assert configs.mesh_shape(c, 16) == (1, 4, 4)


def test_tensor_axis_must_stay_inside_a_host():
    configs.check_tensor_in_host(8, 1, 4)  # one process: the whole mesh is the host's
    configs.check_tensor_in_host(4, 2, 4)
    configs.check_tensor_in_host(2, 4, 8)
    with pytest.raises(configs.ConfigError, match=r"config.mesh.tensor must divide the 4 devices of each host") as e:
        configs.check_tensor_in_host(8, 2, 4)
    assert "[1, 2, 4], got 8" in str(e.value)
    with pytest.raises(configs.ConfigError, match="config.mesh.tensor"):
        configs.check_tensor_in_host(3, 2, 8)


def test_compile_cache_dir_is_checked_and_sets_jax_cache(tmp_path):
    import jax

    c = _load("base")
    assert c.compile_cache_dir == "auto"
    with c.unlocked():  # a non-string value (the command line keeps the field's type)
        del c["compile_cache_dir"]
        c.compile_cache_dir = 3
    with pytest.raises(configs.ConfigError, match="config.compile_cache_dir must be a folder path string"):
        configs.validate(c)
    before = jax.config.jax_compilation_cache_dir
    c = _load("base")
    assert configs.enable_compile_cache(c) == ""  # "auto" on CPU: off
    assert jax.config.jax_compilation_cache_dir == before
    c.compile_cache_dir = str(tmp_path / "xla")
    try:
        configs.enable_compile_cache(c)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_compile_cache_auto_is_a_user_cache_dir_on_accelerators_only(monkeypatch, tmp_path):
    from bipace_jax.config import COMPILE_CACHE_ENV, compile_cache_folder

    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache_folder("auto", "cpu") == ""
    assert compile_cache_folder("auto", "gpu") == str(tmp_path / "bipace_jax" / "xla")
    monkeypatch.setenv(COMPILE_CACHE_ENV, "/scratch/xla")
    assert compile_cache_folder("auto", "tpu") == "/scratch/xla"
    assert compile_cache_folder("", "tpu") == ""
    assert compile_cache_folder(str(tmp_path / "mine"), "cpu") == str(tmp_path / "mine")


def test_paper_config_without_checkpoint_fails_before_anything_runs():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.train",
            f"--config={ROOT}/configs/webshop_qwen2_5_7b.py",
            "--workdir=/tmp/never_used_bipace",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "error: config.model.checkpoint must point at a Hugging Face qwen2_5_7b folder "
        "(a qwen2_5_7b random init trains nothing useful), got ''"
    )
    assert not os.path.exists("/tmp/never_used_bipace")


def test_prompt_template_field_accepts_json_or_reference_only():
    c = _load("textcraft_tiny")
    c.rollout.template = "not a template"
    with pytest.raises(configs.ConfigError, match="config.rollout.template must be '', a JSON object"):
        configs.validate(c)
    c.rollout.template = '{"task_echo": "start"}'
    configs.validate(c)


def test_stop_ids_are_the_union_of_config_generation_config_and_tokenizer(tmp_path):
    # Qwen2.5-Instruct-like: config.json eos 0, generation_config.json [2, 0], tokenizer eos 2
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from bipace_jax.build import stop_token_ids

    GenerationConfig(eos_token_id=[2, 0]).save_pretrained(tmp_path)
    tok = SimpleNamespace(eos_token_id=2)
    assert stop_token_ids((0,), tok, str(tmp_path)) == (0, 2)
    assert stop_token_ids((0,), SimpleNamespace(eos_token_id=None), "") == (0,)  # no folder, no tokenizer EOS
    GenerationConfig(eos_token_id=5).save_pretrained(tmp_path / "single")
    assert stop_token_ids((0,), tok, str(tmp_path / "single")) == (0, 5, 2)


def test_paper_validation_protocol_and_game_options():
    alf, ws, tc = _load("alfworld_qwen2_5_7b"), _load("webshop_qwen2_5_1_5b"), _load("textcraft_qwen2_5_7b")
    assert alf.val.every == ws.val.every == tc.val.every == 5
    assert (alf.val.options, alf.val.holdout_options) == (
        '{"split": "eval_in_distribution"}',  # valid_seen: the paper's in-distribution split
        '{"split": "eval_out_of_distribution"}',  # valid_unseen
    )
    assert (alf.val.num_tasks, alf.val.num_holdout_tasks, alf.env.options) == (128, 128, '{"require_real_data": true}')
    assert (ws.val.options, ws.val.num_tasks, ws.env.options) == (
        '{"split": "test"}',
        256,
        '{"goals": "synthetic", "reward": "success"}',
    )
    assert (tc.val.options, tc.env.options) == ("", "")


def test_alfworld_paper_config_without_data_stops_naming_alfworld_data(tmp_path, monkeypatch):
    pytest.importorskip("alfworld")
    from bipace_jax.trainer import Trainer

    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nothing_here"))
    c = _load("alfworld_qwen2_5_1_5b")
    c.model.preset, c.model.fingerprint_layer, c.mesh.fsdp = "tiny", -1, 1  # never built: the games fail first
    with pytest.raises(configs.ConfigError, match=r"config.env.options: .*set \$ALFWORLD_DATA"):
        Trainer(c, str(tmp_path / "run"), tokenizer=object())


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_a_loaded_checkpoint_keeps_the_configured_parameter_dtype(param_dtype):
    # bf16 activations with fp32 master weights (the paper configs): loading must not cast the weights
    # to the activation dtype (in bf16, 98% of AdamW's 1e-6 updates round away)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bipace_jax import build, sharding
    from bipace_jax.models import load_tokenizer

    c = _load("textcraft_tiny")
    c.model.checkpoint = "bipace_jax/data/textcraft_tiny"  # the shipped warm start
    c.model.dtype, c.model.param_dtype = "bfloat16", param_dtype
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    spec = build.build_spec(c)
    actor = build.build_actor(spec.model, load_tokenizer(spec.model.checkpoint), mesh, seed=spec.seed)
    params = nnx.state(actor, nnx.Param)
    dtypes = {x.dtype for x in jax.tree.leaves(params)}
    assert dtypes == {jnp.dtype(param_dtype)} and actor.dtype == jnp.bfloat16
    # loaded into the mesh's shardings (the 8-device case: tests/test_learner.py)
    want = jax.tree.leaves(sharding.param_shardings(params, mesh))
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(params), want))


def test_webshop_paper_config_without_data_stops_naming_webshop_data(tmp_path, monkeypatch):
    from bipace_jax.trainer import Trainer

    monkeypatch.delenv("WEBSHOP_DATA", raising=False)
    c = _load("webshop_qwen2_5_1_5b")
    c.model.preset, c.model.fingerprint_layer, c.mesh.fsdp = "tiny", -1, 1  # never built: the games fail first
    with pytest.raises(configs.ConfigError, match=r"config.env.options: .*set \$WEBSHOP_DATA.*setup.sh -d small"):
        Trainer(c, str(tmp_path / "run"), tokenizer=object())


@pytest.mark.slow
def test_webshop_paper_config_trains_the_tiny_actor_one_iteration_on_the_sample(tmp_path, monkeypatch):
    """The paper's WebShop setting (our engine, synthetic goals, success reward, validation on the
    test split) on the 10-product sample: a tiny random actor plays and updates once."""
    import configs.textcraft_tiny
    from bipace_jax.tiny import build_game_tokenizer
    from bipace_jax.trainer import Trainer

    monkeypatch.setenv("WEBSHOP_DATA", "sample")
    c = _load("webshop_qwen2_5_1_5b")
    assert json.loads(c.env.options) == {"goals": "synthetic", "reward": "success"}
    c.env.options = '{"goals": "synthetic", "reward": "success", "num_test_goals": 40}'  # 55 goals: 40 test, 15 train
    c.model.preset, c.model.fingerprint_layer, c.model.dtype = "tiny", -1, "float32"
    c.model.hidden_size, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 32, 1, 2, 1
    c.model.intermediate_size, c.mesh.fsdp = 64, 1
    c.env.max_steps, c.env.num_workers = 2, 1
    c.rollout.num_groups, c.rollout.group_size, c.rollout.max_prompt_length = 2, 2, 2048
    c.sampler.max_new_tokens, c.sampler.batch_buckets = 8, (4, 8)
    c.ppo.micro_batch_rows, c.ppo.mini_batch_rows, c.ppo.old_logprobs = 8, 0, "recompute"
    c.val.every, c.val.at_start, c.val.num_tasks, c.log.progress, c.log.plots = 0, False, 3, False, False
    tc = configs.textcraft_tiny.get_config()  # any game's tokenizer serves a random tiny actor
    tc.model.vocab_size = c.model.vocab_size
    tok = build_game_tokenizer(tc, str(tmp_path / "tok"), num_tasks=4)
    tr = Trainer(c, str(tmp_path / "run"), tokenizer=tok)
    try:
        assert len(tr.train_ids) == 15 and tr.panels.task_infos["val"](0)["goal_index"] == 0  # validation: test split
        rec = tr.train_iteration()
    finally:
        tr.close()
    assert tr.iteration == 1 and rec["loss/updates"] >= 1 and rec["train/rows"] > 0


def test_build_spec_decodes_each_section_into_its_dataclass_once():
    import dataclasses

    from bipace_jax.config import OldLogprobs, Panel
    from bipace_jax.models.config import DType, MatmulPrecision, Remat

    c = _load("textcraft_tiny")
    c.val.options = '{"split": "valid"}'
    spec = configs.build_spec(c)
    assert spec.learner.old_logprobs is OldLogprobs.SAMPLER and spec.learner.micro_batch_rows == 32
    assert (spec.sampler.temperature, spec.val_sampler.temperature, spec.loss.temperature) == (0.6, 0.4, 0.6)
    assert spec.rollout.fallback == "inventory" and spec.val_rollout.group_size == spec.val.group_size
    assert (spec.rollout.game, spec.rollout.max_steps, spec.rollout.group_size, spec.val_rollout.group_size) == (
        "textcraft",
        c.env.max_steps,
        8,
        1,
    )
    assert spec.model.dtype is DType.FLOAT32 and spec.model.dtype.jnp == "float32" and spec.val.panel is Panel.SPREAD
    assert (spec.env.options, spec.val.options, spec.val.holdout_options) == ({}, {"split": "valid"}, {})
    assert (spec.num_groups, spec.seed, spec.optim.learning_rate, spec.mesh.shape(4)) == (8, 0, 2e-4, (4, 1, 1))
    assert spec.needs_calibration and spec.controller is None  # calibrated once, no online controller
    assert spec.estimator_at(0.003).epsilon == 0.003 and spec.estimator.epsilon == 0.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1
    with pytest.raises(AttributeError):  # the source config is frozen with the spec
        spec.config.seed = 1
    c.seed = 5  # and a later change of the config does not reach the spec
    assert spec.config.seed == 0
    assert spec.model.remat is Remat.NONE and spec.model.matmul_precision is MatmulPrecision.DEFAULT
    c = _load("textcraft_tiny")
    c.model.remat, c.model.matmul_precision, c.estimator.controller.enabled = "save_dots", "highest", True
    c.estimator.controller.gain = 0.2
    spec = configs.build_spec(c)
    assert spec.model.remat is Remat.SAVE_DOTS and spec.model.matmul_precision is MatmulPrecision.HIGHEST
    # the section's "enabled" decides whether there is a controller; the controller always moves
    ctrl = spec.new_controller()
    assert (ctrl.epsilon, ctrl.gain, ctrl.target_singleton_rate) == (
        0.05,
        0.2,
        c.estimator.controller.target_singleton_rate,
    )
    assert ctrl.update(1.0) == pytest.approx(0.05 + min(0.2 * (1.0 - ctrl.target_singleton_rate), ctrl.max_step))


def test_the_config_module_imports_nothing_from_the_library():
    # config.py sits at the bottom of the imports: the build module maps configs onto the library
    import ast

    tree = ast.parse(open(os.path.join(ROOT, "bipace_jax", "config.py")).read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.split(".")[0] in ("bipace_jax", "environments", "configs", "launch")]
    assert {"jax", "json"} <= set(imported)  # the parser sees its imports at all


def test_webshop_scorer_is_a_checked_env_field_passed_to_the_game():
    from bipace_jax.config import ConfigError, EnvConfig, WebShopScorer

    assert EnvConfig(name="webshop").options == {"scorer": "verl_agent"}  # the baseline's by default
    up = EnvConfig(name="webshop", webshop_scorer="upstream", options='{"split": "test"}')
    assert up.webshop_scorer is WebShopScorer.UPSTREAM and up.options == {"split": "test", "scorer": "upstream"}
    assert EnvConfig(name="textcraft").options == {}  # no other game gets it
    with pytest.raises(ConfigError, match=r"config.env.webshop_scorer must be one of \['verl_agent', 'upstream'\]"):
        EnvConfig(name="webshop", webshop_scorer="newest")
    with pytest.raises(ConfigError, match=r"config.env.webshop_scorer must be 'verl_agent' unless env.name is"):
        EnvConfig(name="textcraft", webshop_scorer="upstream")
    with pytest.raises(ConfigError, match=r"config.env.options must leave 'scorer' to config.env.webshop_scorer"):
        EnvConfig(name="webshop", options='{"scorer": "upstream"}')


def test_an_rl_run_refuses_a_schedule_that_needs_its_step_count():
    import configs.base
    from bipace_jax import build, learner
    from bipace_jax.config import ConfigError, OptimConfig

    c = configs.base.get_config()
    c.optim.schedule = "warmup_cosine"
    with pytest.raises(ConfigError, match=r"^config\.optim\.schedule must be 'constant' for RL"):
        build.build_spec(c)
    c.optim.schedule = "linear"
    with pytest.raises(ConfigError, match=r"^config\.optim\.schedule must be one of"):
        build.build_spec(c)
    with pytest.raises(ConfigError, match=r"^config\.optim\.schedule must be 'constant' where"):
        learner.make_optimizer(OptimConfig(schedule="warmup_cosine"))
