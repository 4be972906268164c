"""`launch.aot`: every program of a run compiled from abstract shapes, memory per chip, fits or not.

The CPU tests compile the tiny default for 8 CPU devices; the committed TPU reports
(`benchmarks/aot/*.json`) are checked always and compiled again when libtpu is installed.
"""

import ast
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {"ppo_grad", "ppo_apply", "logprobs", "prefill", "decode", "estimator"}
PROGRAM_KEYS = {"peak_bytes_per_chip", "argument_bytes", "temp_bytes", "output_bytes", "flops", "compile_s"}
COMMITTED = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "aot", "*__v*.json")))


def _aot(tmp_path, *args, env=None):
    cmd = [sys.executable, "-m", "launch.aot", f"--out={tmp_path}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
def test_cpu8_compiles_every_program_with_fsdp_sharded_fp32_master_weights_and_moments(tmp_path):
    proc = _aot(tmp_path, "--topology=cpu:8", "--config.mesh.data=1", "--config.mesh.fsdp=-1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "textcraft_tiny__cpu-8.json"))
    r = json.load(open(path))
    assert r["topology"] == "cpu:8" and r["chips"] == 8 and r["fits"] is True
    assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert r["param_dtype"] == "float32" and r["hbm_bytes_per_chip"] > 0
    assert set(r["programs"]) == PROGRAMS
    for name, p in r["programs"].items():
        assert PROGRAM_KEYS <= set(p), name
        assert p["total_bytes_per_chip"] == p["peak_bytes_per_chip"] + p["other_resident_bytes"]
    # the update reads fp32 parameters, gradients and both AdamW moments, each split 8 ways:
    # 16 bytes per parameter of a chip's share (norm scales and biases that 8 does not divide stay whole)
    assert 16.0 <= r["ppo_apply_argument_bytes_per_param"] < 17.0
    assert r["programs"]["ppo_grad"]["flops"] > r["programs"]["logprobs"]["flops"] > 0
    # the gradient accumulator (fp32, the parameters' shardings) is donated: its buffer is the output's
    assert r["programs"]["ppo_grad"]["alias_bytes"] == r["resident_bytes_per_chip"]["params"] > 0
    assert "fits: True" in proc.stdout and "ppo_grad" in proc.stdout


@pytest.mark.slow
def test_a_program_over_the_budget_exits_nonzero_and_says_so(tmp_path):
    proc = _aot(tmp_path, "--topology=cpu:2", "--programs=ppo_apply", "--budget=0.0000001")
    assert proc.returncode == 1, proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__cpu-2.json"))
    assert r["fits"] is False and set(r["programs"]) == {"ppo_apply"}
    assert "fits: False" in proc.stdout


@pytest.mark.slow
def test_unknown_topology_and_program_are_refused_by_name(tmp_path):
    proc = _aot(tmp_path, "--topology=cpu:0")
    assert proc.returncode != 0 and "--topology=cpu:0" in proc.stderr
    proc = _aot(tmp_path, "--topology=cpu:3")  # 8 micro-batch rows do not split over 3 devices
    assert proc.returncode != 0 and "ppo.micro_batch_rows" in proc.stderr and "--topology=cpu:3" in proc.stderr
    proc = _aot(tmp_path, "--topology=cpu:1", "--programs=backward")
    assert proc.returncode != 0 and "--programs" in proc.stderr and "backward" in proc.stderr


@pytest.mark.parametrize("path", COMMITTED, ids=[os.path.basename(p) for p in COMMITTED])
def test_committed_tpu_reports_fit_with_fp32_master_weights(path):
    r = json.load(open(path))
    assert r["fits"] is True and set(r["programs"]) == PROGRAMS
    assert r["param_dtype"] == "float32" and r["compute_dtype"] == "bfloat16"
    # the paper's lengths: 2048 prompt tokens (ALFWorld, TextCraft) or 4096 (WebShop) + 512 response tokens
    assert r["shapes"]["prompt_tokens"] == (4096 if r["config"].startswith("webshop") else 2048)
    assert r["shapes"]["response_tokens"] == 512
    for name, p in r["programs"].items():
        assert PROGRAM_KEYS <= set(p), name
        assert p["total_bytes_per_chip"] <= r["budget_fraction"] * r["hbm_bytes_per_chip"], name
    assert 15.5 <= r["ppo_apply_argument_bytes_per_param"] <= 17.0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu (pip install -e ".[tpu]")')
@pytest.mark.parametrize("path", COMMITTED, ids=[os.path.basename(p) for p in COMMITTED])
def test_committed_tpu_reports_compile_again_to_the_same_memory(path, tmp_path):
    r = json.load(open(path))
    overrides = [f"--config.{k}={v}" for k, v in r.get("overrides", {}).items()]
    config = os.path.join(ROOT, "configs", r["config"] + ".py")
    proc = _aot(tmp_path, f"--config={config}", f"--topology={r['topology']}", *overrides)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    again = json.load(open(tmp_path / os.path.basename(path)))
    for name, p in r["programs"].items():
        assert again["programs"][name]["peak_bytes_per_chip"] == p["peak_bytes_per_chip"], name


def _private_uses(source: str) -> list[str]:
    """``_name``s of ``bipace_jax`` that ``source`` imports or reads as a module attribute (dunders aside)."""

    def private(name):
        return any(p.startswith("_") and not p.startswith("__") for p in name.split("."))

    found, modules = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "bipace_jax":
                    found += [a.name] if private(a.name) else []
                    modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bipace_jax":
            for a in node.names:
                if private(node.module) or private(a.name):
                    found.append(f"{node.module}.{a.name}")
                modules.add(a.asname or a.name)  # a module, or an object whose private attributes are as private
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                found.append(f"{ast.unparse(node)}")
    return found


def test_the_private_name_check_finds_imports_and_attribute_reads():
    src = (
        "from bipace_jax import learner, sampling as s\n"
        "from bipace_jax.ppo import _logprobs_program, PPOLearner\n"
        "import bipace_jax.sharding\n"
        "learner._programs(1); s._Static; bipace_jax.sharding._is_variable; PPOLearner._checked\n"
        "learner.step_specs; other._private; learner.__doc__\n"
    )
    assert sorted(_private_uses(src)) == sorted(
        [
            "bipace_jax.ppo._logprobs_program",
            "learner._programs",
            "s._Static",
            "bipace_jax.sharding._is_variable",
            "PPOLearner._checked",
        ]
    )


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "launch", "*.py"))), ids=os.path.basename)
def test_launch_uses_no_private_name_of_the_library(path):
    with open(path) as f:
        assert _private_uses(f.read()) == [], path
