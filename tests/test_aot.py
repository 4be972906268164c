"""`launch.aot`: every program of a run compiled from abstract shapes, memory per chip, fits or not.

The CPU tests compile the tiny default for 8 CPU devices; with libtpu (the `[tpu]` extra, which CI
installs) a tiny run compiles for a 4-host v5e:4x4 slice with the placement checks; the committed TPU
reports (`benchmarks/aot/*.json`) are checked always and compiled again with
``BIPACE_AOT_RECOMPILE=1`` (minutes per paper config on 2 cores).
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
PROGRAMS = {"ppo_grad", "ppo_apply", "logprobs", "prefill", "decode", "val_prefill", "val_decode", "estimator"}
PROGRAM_KEYS = {"peak_bytes_per_chip", "argument_bytes", "temp_bytes", "output_bytes", "flops", "compile_s"}
# a disaggregated run's reports (`--roles`) are checked in tests/test_aot_pod.py
REPORTS = sorted(
    p for p in glob.glob(os.path.join(ROOT, "benchmarks", "aot", "*.json")) if "__cpu" not in p and "__roles-" not in p
)
COMMITTED = [p for p in REPORTS if not p.endswith(("__sft.json", "__slots.json"))]  # an RL run's programs
COMMITTED_SFT = [p for p in REPORTS if p.endswith("__sft.json")]  # the warm start's step at the run's sizes
COMMITTED_SLOTS = [p for p in REPORTS if p.endswith("__slots.json")]  # the continuous scheduler's programs
SFT = {"sft_grad", "sft_apply"}
SLOTS = {"insert_1", "insert", "decode_chunk"}


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
def test_the_warm_starts_step_compiles_on_request_into_its_own_report(tmp_path):
    proc = _aot(
        tmp_path, "--topology=cpu:8", "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--programs=sft_apply,sft_grad"
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["textcraft_tiny__cpu-8__sft.json"]  # beside the run's report, not over it
    r = json.load(open(tmp_path / "textcraft_tiny__cpu-8__sft.json"))
    assert set(r["programs"]) == SFT and r["fits"] is True and "step_time" not in r
    res = r["resident_bytes_per_chip"]
    # fp32 parameters, gradients and both AdamW moments, 8 ways, as the RL update
    assert 16.0 <= r["sft_apply_argument_bytes_per_param"] < 17.0
    g = r["programs"]["sft_grad"]
    assert g["alias_bytes"] == res["params"] > 0  # the donated fp32 gradient accumulator
    assert g["other_resident_bytes"] == res["opt_state"] and r["programs"]["sft_apply"]["other_resident_bytes"] == 0
    assert g["flops"] > 0 and r["transients"]["grad_init"]["bytes_per_chip"] == 2 * res["params"] + res["opt_state"]


@pytest.mark.parametrize("path", COMMITTED_SFT, ids=[os.path.basename(p) for p in COMMITTED_SFT])
def test_committed_warm_start_reports_fit_with_fp32_master_weights(path):
    r = json.load(open(path))
    assert set(r["programs"]) == SFT and r["fits"] is True and "step_time" not in r
    assert r["param_dtype"] == "float32" and r["compute_dtype"] == "bfloat16"
    # the shapes are the run plan's (tests/test_plan.py: golden plans, committed reports at them)
    for name, p in r["programs"].items():
        assert p["total_bytes_per_chip"] <= r["budget_fraction"] * r["hbm_bytes_per_chip"], name
    assert 15.5 <= r["sft_apply_argument_bytes_per_param"] <= 17.0


@pytest.mark.slow
def test_the_slot_programs_compile_on_request_with_the_slot_state_donated(tmp_path):
    # 8 devices, tensor 2: the slots split over data x fsdp = 4, the KV heads over tensor
    mesh = ["--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.mesh.tensor=2", "--config.rollout.num_slots=6"]
    proc = _aot(tmp_path, "--topology=cpu:8", *mesh, "--programs=insert_1,decode_chunk")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["textcraft_tiny__cpu-8__slots.json"]  # beside the run's report
    r = json.load(open(tmp_path / "textcraft_tiny__cpu-8__slots.json"))
    assert set(r["programs"]) == {"insert_1", "decode_chunk"} and r["fits"] is True
    sh = r["shapes"]
    # 6 slots rounded up to the 4 batch shards; S = the 448-token prompt bucket + 32 new tokens
    assert (sh["slots"], sh["slot_cache_columns"], sh["chunk_steps"]) == (8, 480, 8)
    # 3 layers x (k + v) of 8 slots x 2 KV heads x 32 head dims x 480 columns in fp32, split 4 x 2
    cache = 3 * 2 * 8 * 2 * 32 * 480 * 4 // 8
    assert cache < sh["slot_state_bytes_per_chip"] < 1.2 * cache
    for name, p in r["programs"].items():
        # the whole donated slot state is an output buffer: the cache is updated in place
        assert p["slot_state_aliased"] and p["alias_bytes"] == p["slot_state_bytes"] == sh["slot_state_bytes_per_chip"]
        assert p["flops"] > 0, name


@pytest.mark.parametrize("path", COMMITTED_SLOTS, ids=[os.path.basename(p) for p in COMMITTED_SLOTS])
def test_committed_slot_reports_fit_with_the_slot_state_updated_in_place(path):
    r = json.load(open(path))
    run = json.load(open(path.replace("__slots.json", ".json")))  # the run's own report, same config
    assert set(r["programs"]) == SLOTS and r["fits"] is True and r["sampler_mesh"] == run["sampler_mesh"]
    sh = r["shapes"]  # the slot shapes are the run plan's (tests/test_plan.py)
    for name, p in r["programs"].items():
        assert p["slot_state_aliased"] and p["alias_bytes"] >= p["slot_state_bytes"] > 0, name
        assert p["total_bytes_per_chip"] <= r["budget_fraction"] * r["hbm_bytes_per_chip"], name
    st = r["slot_step_time"]["programs"]
    assert st["decode_chunk"]["seconds"] == pytest.approx(sh["chunk_steps"] * st["decode_step"]["seconds"])


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
    # the sampler copy's whole-slice gather is a program of its own when the host samples with another
    # tensor size than training (7B on v5e: pure-FSDP training, tensor-parallel 4 sampler)
    replica = r["sync_route"] == "replica"
    assert r["fits"] is True and set(r["programs"]) == PROGRAMS | ({"sync_gather"} if replica else set())
    assert replica == (r["sampler_mesh"]["tensor"] != r["mesh"]["tensor"])
    assert r["param_dtype"] == "float32" and r["compute_dtype"] == "bfloat16"
    # the shapes are the run plan's (tests/test_plan.py: golden plans, committed reports at them)
    for name, p in r["programs"].items():
        assert PROGRAM_KEYS <= set(p), name
        assert p["total_bytes_per_chip"] <= r["budget_fraction"] * r["hbm_bytes_per_chip"], name
    for name, t in r["transients"].items():  # sync_local, grad_init
        assert t["bytes_per_chip"] <= r["budget_fraction"] * r["hbm_bytes_per_chip"], name
    assert 15.5 <= r["ppo_apply_argument_bytes_per_param"] <= 17.0
    # every tensor group in one host, hosts' batch blocks disjoint, as the trainer asserts
    p = r["placement"]
    assert p["tensor_groups_in_one_process"] and p["batch_shards_disjoint"] and p["batch_blocks_contiguous"]
    assert p["processes"] == r["hosts"] and len(p["device_process"]) == r["chips"]
    st = r["step_time"]
    assert st["iteration_s"] == pytest.approx(sum(st["stages_s"].values()))
    assert st["run_hours"] == pytest.approx(st["iterations"] * st["iteration_s"] / 3600)


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs libtpu (pip install -e ".[tpu]")'
)
# libtpu's lock file would refuse a second process of the machine using libtpu at the same time
LIBTPU_ENV = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")


@pytest.mark.slow
@needs_libtpu
def test_a_tiny_run_compiles_for_a_multi_host_slice_with_the_placement_checks(tmp_path):
    # v5e:4x4 is 4 hosts of 2x2 chips: tensor 4 = one host's chips, data 2 x fsdp 2 over the hosts
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=-1", "--config.mesh.tensor=4"]
    proc = _aot(
        tmp_path,
        "--topology=v5e:4x4",
        "--programs=ppo_apply,prefill,decode,val_prefill,val_decode",
        *mesh,
        env=LIBTPU_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__v5e-4x4.json"))
    assert (r["hosts"], r["chips"], r["mesh"]) == (4, 16, {"data": 2, "fsdp": 2, "tensor": 4})
    p = r["placement"]
    assert p["tensor_groups_in_one_process"] and p["batch_shards_disjoint"] and p["batch_blocks_contiguous"]
    assert p["process_batch_shards"] == {str(h): [h, h + 1] for h in range(4)}  # one tensor group per host
    hosts = list(p["device_process"].values())
    assert sorted(hosts) == sorted([0, 1, 2, 3] * 4)
    assert r["sampler_mesh"] == {"data": 1, "fsdp": 1, "tensor": 4}
    # validation plays 18 goals x 3 seeds: 54 rows over 4 hosts = 14, in the 16-row bucket; rollout: 16 games
    assert (r["shapes"]["val_rows_per_host"], r["shapes"]["val_sampler_batch"]) == (14, 16)
    assert r["programs"]["val_prefill"]["same_as"] == "prefill"
    st = r["step_time"]
    assert st["counts"]["optimizer_steps"] >= 1 and st["programs"]["decode_step"]["bound"] == "memory"
    # the rollout under both schedulers, at the config's sampler buckets and chunk steps
    assert st["run_shape"]["batch_buckets"] == [16, 64] and st["run_shape"]["chunk_steps"] == 8
    assert st["rollout_s_lockstep"] > 0 and st["rollout_s_continuous"] > 0
    assert st["speedup_continuous_rollout"] == pytest.approx(st["rollout_s_lockstep"] / st["rollout_s_continuous"])


@pytest.mark.slow
@needs_libtpu
def test_mini_batch_rows_0_is_one_optimizer_step_of_every_row_in_the_step_time_model(tmp_path):
    # ppo.mini_batch_rows = 0 ("all rows"): the plan decodes it to the 960 rows of an iteration
    # (8 groups x 8 games x 15 turns); the step-time model divided by the raw 0 before
    args = ["--topology=v5e:4x4", "--programs=estimator", "--config.ppo.mini_batch_rows=0"]
    proc = _aot(
        tmp_path, *args, "--config.mesh.data=2", "--config.mesh.fsdp=-1", "--config.mesh.tensor=4", env=LIBTPU_ENV
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__v5e-4x4.json"))
    st = r["step_time"]
    assert r["shapes"]["mini_batch_rows"] == st["run_shape"]["mini_batch_rows"] == 960
    # 16 games a host x 4 hosts x 15 turns = 960 rows: one optimizer step of 960 / (32 x 4) micro-batches
    assert st["counts"]["optimizer_steps"] == 1 and st["counts"]["grad_micro_batches"] == 8


@pytest.mark.slow
@needs_libtpu
def test_the_warm_starts_step_compiles_for_a_multi_host_slice(tmp_path):
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=-1", "--config.mesh.tensor=4"]
    # one row per host: 4 rows, one per data x fsdp shard (the config's 32 a host, 128 rows: 150 s of libtpu compile)
    rows = "--config.ppo.micro_batch_rows=1"
    proc = _aot(tmp_path, "--topology=v5e:4x4", "--programs=sft_grad,sft_apply", *mesh, rows, env=LIBTPU_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__v5e-4x4__sft.json"))
    assert (r["hosts"], r["chips"], r["mesh"]) == (4, 16, {"data": 2, "fsdp": 2, "tensor": 4})
    assert r["shapes"]["micro_batch_rows"] == 4 and r["shapes"]["prompt_tokens"] + r["shapes"]["response_tokens"] == 480
    assert set(r["programs"]) == SFT and r["fits"] is True and "step_time" not in r
    # the gradient's reductions cross the slice: the micro-batch rows are split over data x fsdp
    assert r["programs"]["sft_grad"]["collectives"]["all-reduce"] >= 1


@pytest.mark.slow
@needs_libtpu
@pytest.mark.skipif(
    not os.environ.get("BIPACE_AOT_RECOMPILE"), reason="minutes per paper config: BIPACE_AOT_RECOMPILE=1"
)
@pytest.mark.parametrize("path", COMMITTED, ids=[os.path.basename(p) for p in COMMITTED])
def test_committed_tpu_reports_compile_again_to_the_same_memory(path, tmp_path):
    r = json.load(open(path))
    overrides = [f"--config.{k}={v}" for k, v in r.get("overrides", {}).items()]
    config = os.path.join(ROOT, "configs", r["config"] + ".py")
    slices = f"--num_slices={r.get('num_slices', 1)}"
    proc = _aot(tmp_path, f"--config={config}", f"--topology={r['topology']}", slices, *overrides, env=LIBTPU_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    again = json.load(open(tmp_path / os.path.basename(path)))
    for name, p in r["programs"].items():
        assert again["programs"][name]["peak_bytes_per_chip"] == p["peak_bytes_per_chip"], name


@pytest.mark.slow
def test_truncated_importance_weights_add_the_samplers_logprobs_to_the_gradient_program(tmp_path):
    # ppo.tis_cap > 0: the gradient program reads one more float32 [rows, response] array (split over the
    # 8 chips) and accumulates two more replicated float32 stats (is_weight, is_truncated_frac)
    reports = {}
    for name, extra in (("off", ()), ("on", ("--config.ppo.tis_cap=2.0",))):
        # unpacked rows (the CPU default packs; tests/test_packing.py checks the weights on packed lines)
        flags = ("--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.ppo.old_logprobs=recompute", *extra)
        flags = (*flags, "--config.ppo.pack=False")
        proc = _aot(tmp_path / name, "--topology=cpu:8", "--programs=ppo_grad", *flags)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        reports[name] = json.load(open(tmp_path / name / "textcraft_tiny__cpu-8.json"))
    shapes = reports["on"]["shapes"]
    sampler_bytes = shapes["micro_batch_rows"] * shapes["response_tokens"] * 4 // 8
    on, off = (reports[n]["programs"]["ppo_grad"]["argument_bytes"] for n in ("on", "off"))
    assert on - off == sampler_bytes + 2 * 4


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
