"""The step-time model: its FLOP count against XLA's own count of an unrolled forward, its roofline
against hand-computed 7B figures, and an iteration that is the sum of its stages."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bipace_jax import step_time
from bipace_jax.models import Qwen2Actor, Qwen2Config


def _seven_b_on_v5e_8x8(**kw) -> step_time.RunShape:
    # ALFWorld 7B on v5e:8x8: 16 hosts x 4 chips, mesh (1, 16, 4), 8 games per host, 2048 + 512 tokens
    args = dict(
        chips=64,
        hosts=16,
        fsdp=16,
        tensor=4,
        sampler_tensor=4,
        prompt_tokens=2048,
        response_tokens=512,
        games_per_host=8,
        turns=50,
        micro_batch_rows=64,
        logprob_rows_per_host=4,
        mini_batch_rows=256,
    )
    return step_time.RunShape(**{**args, **kw})


@pytest.mark.slow
def test_forward_flops_match_xla_count_of_an_unrolled_forward():
    # cost_analysis counts every op of a program without loops: the matmuls should be nearly all of it
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(actor)
    rows, t = 4, 64

    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask).logits

    ids = jnp.zeros((rows, t), jnp.int32)
    cost = jax.jit(forward).lower(state, ids, jnp.ones_like(ids)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    m = step_time.ModelShape.of(cfg)
    # the XLA reference attention scores every (query, key) pair: context t, not the causal t / 2
    model = m.forward_flops(rows, t, t, t)
    assert 0.97 < cost["flops"] / model < 1.05, (cost["flops"], model)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
    assert m.params == n_params


def test_seven_b_decode_is_bandwidth_bound_at_the_hand_roofline():
    # By hand: bf16 weights 2 x 7.616e9 B over 4 tensor chips = 3.81 GB per chip; KV of 8 games x
    # 2304 tokens x 2 x 28 layers x 4 heads x 128 x 2 B / 4 chips = 0.264 GB; at 819 GB/s: 4.97 ms
    m = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))
    assert m.params == 7_615_616_512
    r = _seven_b_on_v5e_8x8()
    costs = step_time.program_costs(m, r)
    decode = costs["decode_step"].seconds(step_time.CHIPS["v5e"])
    weights = 2 * m.params / 4
    kv = 8 * (2048 + 256) * 2 * 28 * 4 * 128 * 2 / 4
    assert decode["bound"] == "memory"
    assert decode["memory_s"] == pytest.approx((weights + kv) / 819e9, rel=1e-9)
    assert 4.9e-3 < decode["seconds"] < 5.1e-3
    # prefill of 8 x 2048 tokens is compute-bound: ~2 x 6.5e9 matmul weights x 16k tokens / 4 chips
    prefill = costs["prefill"].seconds(step_time.CHIPS["v5e"])
    assert prefill["bound"] == "compute" and 0.25 < prefill["compute_s"] < 0.32


def test_an_iteration_is_its_stages_and_the_run_is_iterations_of_it():
    m = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))
    r = _seven_b_on_v5e_8x8(val_games_per_host=16, val_every=5, iterations=150)
    e = step_time.estimate(m, r, step_time.CHIPS["v5e"])
    p = {k: v["seconds"] for k, v in e["programs"].items()}
    assert e["counts"] == dict(
        turns=50, decode_steps_per_turn=512, logprob_micro_batches=200, grad_micro_batches=100, optimizer_steps=25
    )
    assert e["stages_s"]["rollout"] == pytest.approx(50 * (p["prefill"] + 512 * p["decode_step"]))
    assert e["stages_s"]["ppo_grad"] == pytest.approx(100 * p["ppo_grad"])
    assert e["iteration_s"] == pytest.approx(sum(e["stages_s"].values()))
    assert e["run_hours"] == pytest.approx(150 * e["iteration_s"] / 3600)
    assert e["chip_hours"] == pytest.approx(64 * e["run_hours"])
    # the gradient micro-batch: 4 forward-equivalents of 64 rows x 2560 tokens over 64 chips
    grad = m.forward_flops(64, 2560, 1280, 512) * 4 / 64
    assert e["programs"]["ppo_grad"]["flops_per_chip"] == pytest.approx(grad)
    # rollout ~144 s, log-probs ~42 s, gradient ~88 s: the hand estimate of ~250 s at the limit
    assert 130 < e["stages_s"]["rollout"] < 160 and 200 < e["iteration_s"] - e["stages_s"]["validation"] < 300


def test_chips_are_found_by_device_kind_and_unknown_kinds_raise():
    assert step_time.chip_for("TPU v5 lite").name == "v5e"
    assert step_time.chip_for("TPU v5").name == "v5p"
    assert step_time.chip_for("TPU v6 lite").name == "v6e"
    assert step_time.chip_for("NVIDIA H100 80GB HBM3").name == "h100"
    with pytest.raises(ValueError, match="no chip peaks"):
        step_time.chip_for("cpu")
    # v4 publishes no ICI figure: its collectives are unknown, never silently free
    v4 = step_time.Cost(1.0, 1.0, 1.0).seconds(step_time.CHIPS["v4"])
    assert math.isnan(v4["collective_s"])


def test_constant_lengths_and_no_latency_give_both_schedulers_the_same_rollout():
    # sigma 0: every response 150 tokens; no env or host time; all 8 games inserted together
    m = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))
    r = _seven_b_on_v5e_8x8(response_sigma=0.0, env_step_s=0.0, host_turn_s=0.0, host_chunk_s=0.0, sim_seeds=1)
    e = step_time.estimate(m, r, step_time.CHIPS["v5e"])
    sched = e["schedulers"]["rollout"]
    assert sched["lockstep"]["decode_steps"] == sched["continuous"]["decode_steps"] == 50 * 149
    assert e["rollout_s_continuous"] == pytest.approx(e["rollout_s_lockstep"], rel=1e-12)
    p = {k: v["seconds"] for k, v in e["programs"].items()}
    # the scheduler model's step reads the whole dense cache (2048 + 512 columns), the bound's the mean
    sec = step_time.decode_cost(m, r, 8, 2048 + 512).seconds(step_time.CHIPS["v5e"])
    assert sec["memory_s"] == pytest.approx((2 * m.params / 4 + 8 * 2560 * 57_344 / 4) / 819e9, rel=1e-9)
    step = sec["seconds"]
    assert e["rollout_s_lockstep"] == pytest.approx(50 * (p["prefill"] + 149 * step))


def test_varied_lengths_favour_continuous_once_inserts_are_not_padded_to_the_whole_batch():
    m = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))
    chip = step_time.CHIPS["v5e"]
    r = _seven_b_on_v5e_8x8(val_games_per_host=8, val_every=5, val_panels=2, sim_seeds=2)
    padded = step_time.estimate(m, dataclasses.replace(r, insert_buckets=(8,)), chip)
    exact = step_time.estimate(m, r, chip)  # SlotHandle.insert_rows: 1, 2, 4, 8
    lock = padded["schedulers"]["rollout"]["lockstep"]
    assert exact["rollout_s_lockstep"] == padded["rollout_s_lockstep"]
    # lockstep waits for the longest of 8 lognormal responses each turn: ~2x the continuous steps
    assert 1.8 < padded["schedulers"]["rollout"]["speedup_decode_steps"] < 2.2
    assert lock["decode_steps"] < 50 * 511  # below the bound's every-response-512-tokens
    assert exact["rollout_s_continuous"] < padded["rollout_s_lockstep"] < padded["stages_s"]["rollout"]
    assert 1.4 < exact["speedup_continuous_rollout"] < 2.0
    # an insert padded to the 8-row bucket costs the lockstep turn's prefill
    units = padded["schedulers"]["rollout"]["unit_costs_s"]
    assert units["insert_one"] == units["lockstep_prefill"]
    assert padded["speedup_continuous_rollout"] < 1
    for e in (padded, exact):
        rest = e["iteration_s"] - e["stages_s"]["rollout"] - e["stages_s"]["validation"]
        for name in ("lockstep", "continuous"):
            assert e[f"iteration_s_{name}"] == pytest.approx(rest + e[f"rollout_s_{name}"] + e[f"validation_s_{name}"])
            assert e[f"run_hours_{name}"] == pytest.approx(150 * e[f"iteration_s_{name}"] / 3600)
        val = e["schedulers"]["validation"]["continuous"]["wall_s"]
        assert e["validation_s_continuous"] == pytest.approx(2 * val / 5)


def test_the_dense_slot_cache_is_charged_when_prompts_are_shorter_than_the_bucket():
    m = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))
    r = _seven_b_on_v5e_8x8(rollout_prompt_tokens=1024, sim_seeds=1)
    units = step_time.rollout_model(m, r, step_time.CHIPS["v5e"], 8)["unit_costs_s"]
    # lockstep: 1024 + 512 columns per row; the slots: 2048 + 512
    extra = 8 * 1024 * 57_344 / 4 / 819e9
    assert units["slot_decode_step"] - units["lockstep_decode_step"] == pytest.approx(extra, rel=1e-6)


def test_head_split_hand_cases():
    # TextCraft at a 1024 bucket, 4 groups of 8 on 32 rows (heads padded to the 8-row batch bucket):
    # Ts 128 holds the 118-token suffix, Th 896; 8 x 896 + 32 x 128 = 11264 of 32 x 1024 = 32768 tokens
    s = step_time.head_split(1024, 475, 118, rows=32, head_rows=8)
    assert (s.head_width, s.suffix_width, s.head_rows, s.tokens, s.plain_tokens) == (896, 128, 8, 11264, 32768)
    # one group of 8 on 8 rows: its head fills all 8 head rows, 8 x 896 + 8 x 128 = the plain 8192: no plan
    assert step_time.head_split(1024, 475, 118, rows=8, head_rows=8) is None
    # the smallest width that holds the suffix: 20 + the 8 head tokens past Th 992 fit Ts 32
    s = step_time.head_split(1024, 1000, 20, rows=32, head_rows=8)
    assert (s.head_width, s.suffix_width, s.tokens) == (992, 32, 8 * 992 + 32 * 32)
    # a head longer than Th 384 is cut: its 16 extra tokens join the 100-token suffix, within 128
    s = step_time.head_split(512, 400, 100, rows=32, head_rows=8)
    assert (s.head_width, s.suffix_width, s.tokens) == (384, 128, 8 * 384 + 32 * 128)
    # ALFWorld at 512: widths 32 and 128 only (512 is not <= P / 2), the 236-token suffix fits neither
    assert step_time.head_split(512, 105, 236, rows=32, head_rows=8) is None
    with pytest.raises(ValueError, match="head_split"):
        step_time.head_split(512, 300, 300, rows=8, head_rows=8)
    with pytest.raises(ValueError, match="head_rows"):
        step_time.head_split(512, 100, 100, rows=8, head_rows=16)


@pytest.mark.parametrize(
    "rows, groups, head, suffix, bucket",
    [(32, 4, 475, 118, 1024), (32, 4, 400, 100, 512), (8, 1, 475, 118, 1024), (32, 4, 105, 236, 512)],
)
def test_head_split_is_what_plan_heads_takes_for_equal_rows(rows, groups, head, suffix, bucket):
    from bipace_jax.sampling import heads
    from bipace_jax.sampling.heads import plan_heads

    assert step_time.HEAD_MIN_SUFFIX == heads.MIN_SUFFIX
    assert step_time.HEAD_SUFFIX_STEP == heads.SUFFIX_STEP
    assert step_time.HEAD_MAX_COST_FRACTION == heads.MAX_COST_FRACTION
    assert step_time._suffix_ladder(bucket) == list(heads.suffix_ladder(bucket))
    buckets = (8, 16, 32, 64, 128)  # the paper configs' sampler.batch_buckets

    def head_bucket(n):
        return next(b for b in buckets if b >= n)

    rng = np.random.default_rng(0)
    heads = [rng.integers(1, 1000, head) for _ in range(groups)]
    # every row: its group's head, then its own suffix (first token differs within a group)
    arrays = [np.concatenate([heads[r % groups], [1000 + r], rng.integers(1, 1000, suffix - 1)]) for r in range(rows)]
    plan = plan_heads(arrays, [r % groups for r in range(rows)], bucket, rows, min_tokens=64, head_bucket=head_bucket)
    s = step_time.head_split(bucket, head, suffix, rows, min(head_bucket(groups), rows))
    assert (plan is None) == (s is None)
    if plan is not None:
        assert (plan.head_width, plan.suffix_width, plan.tokens, plan.plain_tokens) == (
            s.head_width,
            s.suffix_width,
            s.tokens,
            s.plain_tokens,
        )


def test_the_lockstep_prefill_shares_heads_where_the_sampler_does():
    m = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))
    chip = step_time.CHIPS["v5e"]
    # 32 games (4 groups of 8) per host at TextCraft's measured lengths in the 1024 bucket
    base = _seven_b_on_v5e_8x8(
        games_per_host=32, rollout_prompt_tokens=1024, sim_seeds=1, val_games_per_host=8, val_every=5
    )
    shared = dataclasses.replace(base, shared_head_tokens=475, head_suffix_tokens=118, group_size=8)
    plain, e = step_time.estimate(m, base, chip), step_time.estimate(m, shared, chip)
    split = step_time.head_split(1024, 475, 118, 32, 8)
    info = e["schedulers"]["rollout"]["shared_heads"]
    assert info["applies"] and info["split"]["tokens"] == 11264
    # every game plays 50 turns: 50 shared prefills, 8 head rows of 896 tokens and 32 suffixes of 128
    one = step_time.shared_prefill_cost(m, shared, split)
    flops = m.forward_flops(8, 896, 448, 1) / 4 + m.forward_flops(32, 128, 896 + 64, 1) / 4
    assert one.flops == pytest.approx(flops, rel=1e-12)
    assert one.seconds(chip)["bound"] == "compute"
    lock = e["schedulers"]["rollout"]["lockstep"]["stages_s"]
    assert lock["prefill"] == pytest.approx(50 * one.seconds(chip)["seconds"], rel=1e-12)
    # 11264 of 32768 tokens (0.34); the suffixes attend to the 896 head columns, so a little more
    ratio = lock["prefill"] / plain["schedulers"]["rollout"]["lockstep"]["stages_s"]["prefill"]
    assert 0.34 < ratio < 0.42, ratio
    assert e["rollout_s_lockstep"] == pytest.approx(
        plain["rollout_s_lockstep"]
        - plain["schedulers"]["rollout"]["lockstep"]["stages_s"]["prefill"]
        + lock["prefill"]
    )
    # the continuous insert and the validation (one game per task) prefill whole prompts
    assert e["rollout_s_continuous"] == plain["rollout_s_continuous"]
    assert e["validation_s_lockstep"] == plain["validation_s_lockstep"]
    assert not e["schedulers"]["validation"]["shared_heads"]["applies"]
    # one group of 8 on a host: its head pads to the 8-row bucket, no saving, no plan
    one_group = step_time.estimate(m, dataclasses.replace(shared, games_per_host=8), chip)
    assert "no plan" in one_group["schedulers"]["rollout"]["shared_heads"]["why_not"]
    # a sampler splitting rows over 4 devices (1.5B hosts) shares nothing
    split_rows = step_time.estimate(m, dataclasses.replace(shared, sampler_tensor=1), chip)
    assert "splits rows 4 ways" in split_rows["schedulers"]["rollout"]["shared_heads"]["why_not"]
    assert (
        split_rows["rollout_s_lockstep"]
        == step_time.estimate(m, dataclasses.replace(base, sampler_tensor=1), chip)["rollout_s_lockstep"]
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("response_sigma", -0.5),
        ("rollout_prompt_tokens", 4096),
        ("env_step_s", -1.0),
        ("insert_buckets", (0, 8)),
        ("shared_head_tokens", 2048),
        ("head_suffix_tokens", 2049),
        ("group_size", 0),
    ],
)
def test_bad_scheduler_fields_are_named(field, value):
    with pytest.raises(ValueError, match=rf"RunShape\.{field}"):
        _seven_b_on_v5e_8x8(**{field: value})


def test_the_committed_step_table_is_the_model_of_the_committed_reports():
    # launch.step_table recomputes the model from the AOT reports' shapes: the bound is the committed
    # one, and benchmarks/step_time.json (docs/pod.md's table) is what the model gives today
    import json
    import os

    from launch import step_table
    from launch._common import ROOT

    rows = step_table.rows(
        os.path.join(ROOT, "benchmarks", "aot"), os.path.join(ROOT, "benchmarks", "shared_heads.json")
    )
    committed = json.load(open(os.path.join(ROOT, "benchmarks", "step_time.json")))["rows"]
    assert [r["report"] for r in rows] == [r["report"] for r in committed] and len(rows) == 5
    for new, old in zip(rows, committed):
        assert new["iteration_s_bound"] == pytest.approx(new["committed_iteration_s"], rel=1e-9)
        for key in (
            "rollout_s_lockstep",
            "rollout_s_continuous",
            "rollout_s_continuous_exact_inserts",
            "rollout_s_lockstep_shared_heads",
            "rollout_s_lockstep_measured_prompts_shared_heads",
        ):
            assert new[key] == pytest.approx(old[key], rel=1e-9), (new["report"], key)
        assert new["rollout_s_continuous_exact_inserts"] < new["rollout_s_lockstep"] <= new["rollout_s_bound"] * 1.01
        # prompts at the bucket: no head under P / 2 has a plan; measured prompts: never slower
        assert new["rollout_s_lockstep_shared_heads"] == new["rollout_s_lockstep"]
        assert new["rollout_s_lockstep_measured_prompts_shared_heads"] <= new["rollout_s_lockstep_measured_prompts"]


def test_calibration_takes_the_median_measured_over_modelled_ratio_per_program():
    from bipace_jax.step_time import Calibration

    def preset(lp, upd, pre, dec):
        return {
            "programs": {
                "logprobs": {"measured_over_model": lp},
                "update": {"measured_over_model": upd},
                "sampler": {
                    str(b): {"prefill": {"measured_over_model": p}, "decode": {"measured_over_model": d}}
                    for b, p, d in zip((16, 64), pre, dec)
                },
            }
        }

    report = {
        "provenance": {"device": "NVIDIA H200", "date": "2026-12-04", "commit": "abc"},
        "presets": {
            "0.5b": preset(8.0, 9.0, (2.0, 3.0), (4.0, 5.0)),
            "1.5b": preset(4.0, 3.0, (1.0, 1.5), (2.5, 2.0)),
            "broken": {"programs": {"logprobs": {"error": "OOM"}}},
        },
    }
    c = Calibration.from_report(report)
    # medians: log-prob (8, 4) -> 6; update (9, 3) -> 6; prefill (2, 3, 1, 1.5) -> 1.75; decode (4, 5, 2.5, 2) -> 3.25
    assert c.factors == {"logprobs": 6.0, "ppo_grad": 6.0, "ppo_apply": 6.0, "prefill": 1.75, "decode_step": 3.25}
    assert (c.device, c.commit) == ("NVIDIA H200", "abc")
    assert c.expected({"logprobs": 0.5, "sync": 2.0}) == {"logprobs": 3.0, "sync": 2.0}
    with pytest.raises(ValueError, match="no provenance"):
        Calibration.from_report({"presets": {}})


def test_the_update_memory_estimate_hand_case():
    # H 8, Q 2 x 4 = 8, KV 4, I 16, L 2, V 10 tied; P = 2 x (576 matmul + 8 + 8 + 16) + 80 + 8 = 1304.
    # tensor 2: Q 4, KV 2, I 8 a chip; 4 rows over 2 batch shards: 2 rows x (6 + 2) = 16 tokens a chip.
    # kept per token (bf16): full H = 8; save_dots 3H + Q + 2KV + 2I = 48; none 6H + 3Q + 3KV + 4I = 98
    m = step_time.ModelShape(8, 16, 2, 2, 1, 4, 10, True)
    r = step_time.RunShape(
        chips=4, hosts=1, fsdp=2, tensor=2, sampler_tensor=2, prompt_tokens=6, response_tokens=2,
        games_per_host=1, turns=1, micro_batch_rows=4, logprob_rows_per_host=1, mini_batch_rows=4,
    )  # fmt: skip
    assert m.params == 1304
    # state 16 x 1304 / 4 + the reference's 2 x 1304 / 2; working: 2 x 16 x 98 x 2 + 2 x 576 x 2 / 2
    # + the head 10 x 8 x 2 / 2 + 3 x 2 rows x 4 chunk x 10 x 4 B
    state, working = 5216 + 1304, 6272 + 1152 + 80 + 960
    for policy, saved in (("full", 2 * 16 * 8 * 2), ("save_dots", 2 * 16 * 48 * 2), ("none", 2 * 16 * 98 * 2)):
        e = step_time.update_memory(m, r, policy, reference=True, logprob_chunk=4)
        assert e == dict(state=state, saved=saved, working=working, total=state + saved + working), policy
    assert step_time.update_memory(m, r, "full", reference=False, logprob_chunk=4)["state"] == 5216
    # ppo.logprob_chunk=0 (the base config's): the LM head over all 2 response positions at once,
    # 3 x 2 rows x 2 positions x 10 x 4 B of fp32 logits, not none
    e = step_time.update_memory(m, r, "full", reference=True, logprob_chunk=0)
    assert e["working"] == 6272 + 1152 + 80 + 3 * 2 * 2 * 10 * 4
    assert e == step_time.update_memory(m, r, "full", reference=True, logprob_chunk=2)
    with pytest.raises(ValueError, match="remat must be one of"):
        step_time.update_memory(m, r, "auto", reference=True, logprob_chunk=4)
