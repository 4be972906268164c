"""The run plan (`bipace_jax.plan`): golden plans of every shipped RL config at its intended slice,
hand-computed below, the default config's validation panels, ``mini_batch_rows = 0`` decoded once, and
the committed ``launch.aot`` reports compiled at the plan's shapes."""

import dataclasses
import glob
import importlib
import json
import os

import pytest

from bipace_jax import build, step_time, validation
from bipace_jax.config import ConfigError
from bipace_jax.models import Qwen2Config
from bipace_jax.plan import HostLayout, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# topology -> (processes, devices per process): libtpu's slices (4-chip hosts)
SLICES = {
    "cpu:1": (1, 1),
    "cpu:8": (1, 8),
    "v5e:4x4": (4, 4),
    "2xv5e:4x4": (8, 4),
    "v5e:8x8": (16, 4),
    "v5p:2x2x4": (4, 4),
}
FIELDS = (
    "groups_per_host games_per_host sampler_batch sampler_calls prompt_bucket response_tokens row_capacity "
    "estimator_rows slots slot_rows val_rows_per_host val_sampler_batch val_sampler_calls val_panels "
    "micro_batch_rows_global logprob_rows_per_host rows_per_iteration mini_batch_rows optimizer_steps_per_epoch "
    "micro_batches_per_optimizer_step logprob_passes"
).split()

# Hand-computed (per host unless global):
#   games = num_groups / hosts x group_size; sampler batch = the first batch bucket >= games, rounded up
#   to the host's row shards (devices per host / sampler tensor); row capacity = group_size x max_steps
#   rounded up to 16; estimator rows = games x max_steps; validation rows = ceil(panel games / hosts);
#   micro rows global = ppo.micro_batch_rows x hosts; log-prob rows = micro rows rounded up to the row
#   shards; rows per iteration = num_groups x group_size x max_steps; optimizer steps = ceil(rows / mini);
#   micro-batches per step = mini / micro rows global; log-prob passes = recompute (1) + KL (1).
# fmt: off
GOLDEN = {
    # 8 groups x 8 on one CPU device; buckets (16, 64), prompt 448 of (160..448), 32 new tokens; 8 x 15
    # = 120 -> 128 rows a group; validation bound (18 + 16 goals) x 3 seeds, 54 rows; 960 rows / 256.
    ("textcraft_tiny", "cpu:1"): (8, 64, 64, 1, 448, 32, 128, 960, 64, 64, 54, 64, 1, 2, 32, 32, 960, 256, 4, 8, 1),
    # base: 16 x 8 games on 8 devices (8 row shards), 2048 of (128..4096), 8 x 50 = 400 rows a group,
    # 64-goal panels; mini_batch_rows 0: all 6400 rows in one step of 800 micro-batches of 8
    ("base", "cpu:8"): (16, 128, 128, 1, 2048, 512, 400, 6400, 128, 128, 64, 64, 1, 2, 8, 8, 6400, 6400, 1, 800, 2),
    # 4 hosts of 4 chips, 4 row shards: 4 groups, 32 games; panels 128 + 128 over 4 hosts; micro 8 x 4
    ("alfworld_qwen2_5_1_5b", "v5e:4x4"): (4, 32, 32, 1, 2048, 512, 400, 1600, 32, 32, 32, 32, 1, 2, 32, 8, 6400, 256, 25, 8, 2),
    # two slices, data 2: 8 hosts, 2 groups, 16 games; 128 / 8 = 16 validation rows; micro 8 x 8
    ("alfworld_qwen2_5_1_5b", "2xv5e:4x4"): (2, 16, 16, 1, 2048, 512, 400, 800, 16, 16, 16, 16, 1, 2, 64, 8, 6400, 256, 25, 4, 2),
    # 16 hosts sampling 4-way tensor parallel (1 row shard): 1 group, 8 games; micro 4 x 16
    ("alfworld_qwen2_5_7b", "v5e:8x8"): (1, 8, 8, 1, 2048, 512, 400, 400, 8, 8, 8, 8, 1, 2, 64, 4, 6400, 256, 25, 4, 2),
    ("alfworld_qwen2_5_7b", "v5p:2x2x4"): (4, 32, 32, 1, 2048, 512, 400, 1600, 32, 32, 32, 32, 1, 2, 16, 4, 6400, 256, 25, 16, 2),
    # WebShop: 15 turns (8 x 15 = 120 -> 128), 4096-token prompts; 256 test goals, no held-out panel
    ("webshop_qwen2_5_1_5b", "v5e:4x4"): (4, 32, 32, 1, 4096, 512, 128, 480, 32, 32, 64, 64, 1, 1, 32, 8, 1920, 64, 30, 2, 2),
    # 7B on v5e: batch buckets (8,) only: 16 validation rows are 2 calls of 8
    ("webshop_qwen2_5_7b", "v5e:8x8"): (1, 8, 8, 1, 4096, 512, 128, 120, 8, 8, 16, 8, 2, 1, 64, 4, 1920, 64, 30, 1, 2),
    # TextCraft paper settings: 64 training goals, one panel
    ("textcraft_qwen2_5_1_5b", "v5e:4x4"): (4, 32, 32, 1, 2048, 512, 400, 1600, 32, 32, 16, 16, 1, 1, 32, 8, 6400, 256, 25, 8, 2),
    ("textcraft_qwen2_5_7b", "v5e:8x8"): (1, 8, 8, 1, 2048, 512, 400, 400, 8, 8, 4, 8, 1, 1, 64, 4, 6400, 256, 25, 4, 2),
}
# fmt: on
SHIPPED_RL = sorted(
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if not os.path.basename(p).startswith(("_", "sft_", "textcraft_tasks"))
)


def _spec(name: str, **overrides):
    c = importlib.import_module(f"configs.{name}").get_config()
    for k, v in overrides.items():
        section, field = k.split(".")
        c[section][field] = v
    return build.build_spec(c, abstract=True)


def _layout(spec, slice_name: str) -> HostLayout:
    processes, local = SLICES[slice_name]
    return HostLayout.of(spec, processes, processes * local, local)


def test_every_shipped_rl_config_has_a_golden_plan():
    assert SHIPPED_RL == sorted({name for name, _ in GOLDEN})


@pytest.mark.parametrize("name,slice_name", list(GOLDEN), ids=[f"{n}@{s}" for n, s in GOLDEN])
def test_golden_plans_of_the_shipped_configs(name, slice_name):
    overrides = {"mesh.data": 2} if slice_name.startswith("2x") else {}
    spec = _spec(name, **overrides)
    p = plan(spec, _layout(spec, slice_name))
    assert tuple(getattr(p, f) for f in FIELDS) == GOLDEN[name, slice_name]
    assert p.group_capacity == p.groups_per_host and p.chunk_steps == 8 and p.turns == spec.rollout.max_steps
    assert p.val_games_exact is False  # no panels given: the config's bound


def test_the_default_config_plays_84_validation_games():
    # 18 RL goals and 10 held-out goals exist (the config asks for 16: clipped), 3 seeds each
    spec = _spec("textcraft_tiny")
    p = plan(spec, _layout(spec, "cpu:1"), validation.select(spec, spec.env.name).games)
    assert p.val_games == {"val": 54, "val/holdout": 30} and p.validation_games == 84 and p.val_games_exact
    assert p.summary()["validation_games"] == 84
    # the bound without the game: 18 + 16 goals x 3 seeds
    assert plan(spec, _layout(spec, "cpu:1")).validation_games == 102
    # validation rows per host: each host plays every 4th pair, val.group_size times
    spec4 = _spec("textcraft_tiny", **{"rollout.num_groups": 8})
    four = HostLayout(processes=4, devices=4, local_devices=1, data=4, fsdp=1, tensor=1, sampler_tensor=1)
    assert plan(spec4, four, validation.select(spec, spec.env.name).games).val_rows_per_host == 14  # ceil(54 / 4)


def test_mini_batch_rows_0_is_all_rows_decoded_once_and_the_step_time_model_runs_on_it():
    spec = _spec("textcraft_tiny", **{"ppo.mini_batch_rows": 0})
    p = plan(spec, _layout(spec, "cpu:1"))
    assert (p.mini_batch_rows, p.optimizer_steps_per_epoch, p.micro_batches_per_optimizer_step) == (960, 1, 30)
    shape = p.run_shape(spec.model)
    assert shape.mini_batch_rows == 960
    model = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_1_5b"))
    counts = step_time.estimate(model, shape, step_time.CHIPS["v5e"])["counts"]
    assert counts["optimizer_steps"] == 1 and counts["grad_micro_batches"] == 30  # 960 rows / 32
    with pytest.raises(ValueError, match=r"RunShape.mini_batch_rows must be >= 1"):
        dataclasses.replace(shape, mini_batch_rows=0)


def test_a_plan_that_does_not_split_names_the_field():
    spec = _spec("alfworld_qwen2_5_1_5b")
    with pytest.raises(ConfigError, match=r"config.rollout.num_groups must be a multiple of the process count 32"):
        HostLayout.of(spec, 32, 128, 4)
    spec = _spec("textcraft_tiny", **{"ppo.micro_batch_rows": 3, "ppo.mini_batch_rows": 0})
    with pytest.raises(ConfigError, match=r"config.ppo.micro_batch_rows must be a multiple of the 2 batch shards"):
        HostLayout.of(spec, 1, 2, 2)


# a disaggregated run's report (`launch.aot --roles`) has its own test (tests/test_aot_pod.py)
COMMITTED = sorted(p for p in glob.glob(os.path.join(ROOT, "benchmarks", "aot", "*.json")) if "__roles-" not in p)


@pytest.mark.parametrize("path", COMMITTED, ids=[os.path.basename(p) for p in COMMITTED])
def test_the_committed_aot_reports_are_compiled_at_the_plans_shapes(path):
    r = json.load(open(path))
    spec = _spec(r["config"], **{k: int(v) for k, v in r.get("overrides", {}).items()})
    slices = f"{r['num_slices']}x" if r.get("num_slices", 1) > 1 else ""
    p = plan(spec, _layout(spec, slices + r["topology"]))
    sh = r["shapes"]
    assert (r["mesh"]["data"], r["mesh"]["fsdp"], r["mesh"]["tensor"]) == p.layout.mesh_shape
    assert r["sampler_mesh"]["tensor"] == p.layout.sampler_tensor
    assert (sh["prompt_tokens"], sh["response_tokens"], sh["sampler_batch"]) == (
        p.prompt_bucket,
        p.response_tokens,
        p.sampler_batch,
    )
    assert (sh["micro_batch_rows"], sh["mini_batch_rows"], sh["estimator_rows"]) == (
        p.micro_batch_rows_global,
        p.mini_batch_rows,
        p.estimator_rows,
    )
    assert (sh["val_rows_per_host"], sh["val_sampler_batch"]) == (p.val_rows_per_host, p.val_sampler_batch)
    if "slots" in sh:
        assert (sh["slots"], sh["chunk_steps"]) == (p.slot_rows, p.chunk_steps)
        assert sh["slot_cache_columns"] == p.prompt_bucket + p.response_tokens
        assert (sh["insert_1_batch"], sh["insert_batch"]) == (p.batch_bucket(1), p.batch_bucket(p.slots))
    if "step_time" in r:
        shape = dataclasses.asdict(p.run_shape(spec.model))
        committed = r["step_time"]["run_shape"]
        assert {k: shape[k] for k in committed} == {
            k: tuple(v) if isinstance(v, list) else v for k, v in committed.items()
        }


def test_remat_auto_takes_the_least_recompute_whose_estimate_fits_80_percent_of_hbm():
    from bipace_jax.plan import REMAT_AUTO_BUDGET, remat_estimate, resolve_remat

    estimate = {"none": 90, "save_dots": 70, "full": 50}
    assert REMAT_AUTO_BUDGET == 0.8
    assert resolve_remat(estimate, 200) == "none"
    assert resolve_remat(estimate, 100) == "save_dots"  # cutoff 80
    assert resolve_remat(estimate, 80) == "full"  # cutoff 64
    assert resolve_remat(estimate, 50) == "full"  # nothing fits: the least memory (launch.aot says it does not)
    assert resolve_remat(estimate, 0) == "none"  # CPU: host memory
    # 1.5B ALFWorld on v5e:4x4 (16 GiB chips): the estimate (step_time.update_memory) is 19.8 / 12.9 / 6.7 GiB
    spec = _spec("alfworld_qwen2_5_1_5b", **{"model.remat": "auto"})
    layout = _layout(spec, "v5e:4x4")
    p = plan(spec, layout, hbm_bytes=16 << 30)
    est = remat_estimate(spec, p)
    assert [round(est[k] / 2**30, 1) for k in ("none", "save_dots", "full")] == [19.8, 12.9, 6.7]
    assert p.remat == "full" and p.remat_estimate["bytes"] == est
    assert p.remat_estimate["cutoff_bytes"] == 0.8 * (16 << 30)
    assert p.run_shape(spec.model).remat == "full" and p.summary()["remat"] == "full"
    # a 95 GB chip (v5p) holds every activation: none
    assert plan(spec, layout, hbm_bytes=95 * 10**9).remat == "none"
    # a configured policy is the plan's as it is, with no estimate
    fixed = plan(_spec("alfworld_qwen2_5_1_5b"), layout)
    assert fixed.remat == "full" and fixed.remat_estimate == {}


def test_remat_estimate_counts_activations_in_the_models_compute_dtype():
    from bipace_jax.plan import remat_estimate

    # the policies differ only in the saved activations, which are in model.dtype: fp32 doubles bf16's
    est = {}
    for dtype in ("bfloat16", "float32"):
        spec = _spec("alfworld_qwen2_5_1_5b", **{"model.remat": "auto", "model.dtype": dtype})
        est[dtype] = remat_estimate(spec, plan(spec, _layout(spec, "v5e:4x4"), hbm_bytes=16 << 30))
    for policy in ("none", "save_dots"):
        gap = {d: e[policy] - e["full"] for d, e in est.items()}
        assert gap["float32"] == pytest.approx(2 * gap["bfloat16"]), policy
    assert est["float32"]["full"] > est["bfloat16"]["full"]  # the layer being differentiated, the head


def test_remat_auto_on_cpu_is_none_and_the_learner_sets_it_on_the_actor():
    import jax

    from bipace_jax import sharding
    from bipace_jax.models.config import Remat

    spec = _spec("textcraft_tiny", **{"model.remat": "auto"})
    assert spec.model.remat == "auto"
    assert plan(spec, _layout(spec, "cpu:1")).remat == "none"  # hbm from the CPU device: 0
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    assert build.resolved_remat(spec, mesh, None) == "none"
    # the actor holds the least-memory policy until the learner resolves "auto"
    arch = build.actor_architecture(spec.model, spec.model.vocab_size)
    actor = build.init_actor(spec.model, arch)
    assert actor.remat_policy is Remat.FULL
    build.ppo_learner(spec, actor, mesh, mesh, support=spec.model.vocab_size)
    assert actor.remat_policy is Remat.NONE
    with pytest.raises(ConfigError, match=r"config.model.remat must be one of \['none', 'full', 'save_dots', 'auto'\]"):
        _spec("textcraft_tiny", **{"model.remat": "some"})


def test_hbm_of_a_device_this_process_cannot_ask_comes_from_the_data_sheet():
    from bipace_jax import step_time
    from bipace_jax.plan import device_hbm_bytes

    class Remote:  # another process's chip (or a topology description's): its allocator is not ours to ask
        platform, device_kind = "tpu", "TPU v5 lite"

        def memory_stats(self):
            raise RuntimeError("memory_stats is only supported for addressable devices")

    class Local(Remote):
        def memory_stats(self):
            return {"bytes_limit": 15 << 30}

    assert device_hbm_bytes(Remote()) == step_time.chip_for("TPU v5 lite").hbm_bytes > 0
    assert device_hbm_bytes(Local()) == 15 << 30
