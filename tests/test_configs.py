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
from bipace_jax.config import estimator_config

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
    # verl-agent's ppo_mini_batch_size: one AdamW step per 256 (ALFWorld, TextCraft) / 64 (WebShop) step rows
    assert c.ppo.mini_batch_rows == (64 if game == "webshop" else 256) and c.ppo.epochs == 1
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
        (
            "model.matmul_precision",
            "tf32",
            "config.model.matmul_precision must be one of ['default', 'high', 'highest'], got 'tf32'",
        ),
        ("ppo.dual_clip", 0.5, "config.ppo.dual_clip must be > 1 (None or, in a run config, 0 = off), got 0.5"),
        ("ppo.mini_batch_rows", 10, "config.ppo.mini_batch_rows must be a multiple of ppo.micro_batch_rows"),
        ("ppo.old_logprobs", "sampler", "config.ppo.old_logprobs must be 'recompute' unless"),
        ("ppo.epochs", 2, "config.ppo.old_logprobs must not be 'fused' unless ppo.epochs == 1"),
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
            "config.model.checkpoint must be a Hugging Face folder holding config.json",
        ),
        ("mesh.data", 0, "config.mesh.data must be an int >= 1 or -1"),
        (
            "sampler.length_buckets",
            (512, 256),
            "config.sampler.length_buckets must be a non-empty strictly ascending tuple",
        ),
    ],
)
def test_bad_field_fails_with_one_line_naming_it(field, value, message):
    c = _load("textcraft_tiny")
    if field == "ppo.old_logprobs":
        c.sampler.top_p = 0.9  # a tempered sampler is fine (PPO trains the tempered policy); a truncated one is not
    if field == "ppo.epochs":
        c.ppo.old_logprobs, c.ppo.mini_batch_rows = "fused", 0
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

    from bipace_jax.config import stop_token_ids

    GenerationConfig(eos_token_id=[2, 0]).save_pretrained(tmp_path)
    tok = SimpleNamespace(eos_token_id=2)
    assert stop_token_ids((0,), tok, str(tmp_path)) == (0, 2)
    assert stop_token_ids((0,), SimpleNamespace(eos_token_id=None), "") == (0,)  # no folder, no tokenizer EOS
    GenerationConfig(eos_token_id=5).save_pretrained(tmp_path / "single")
    assert stop_token_ids((0,), tok, str(tmp_path / "single")) == (0, 5, 2)
