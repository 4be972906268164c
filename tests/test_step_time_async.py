"""The step-time model's asynchronous schedule and calibrated expected time, on hand-computed cases."""

import dataclasses

import pytest

from bipace_jax import step_time
from bipace_jax.models import Qwen2Config
from tests.test_step_time import _seven_b_on_v5e_8x8

V5E = step_time.CHIPS["v5e"]


def _seven_b(**kw) -> step_time.RunShape:
    # test_step_time's ALFWorld 7B on v5e:8x8 (16 hosts x 4 chips, 8 games a host), validating 16 games a host
    return _seven_b_on_v5e_8x8(**{"val_games_per_host": 16, "val_every": 5, **kw})


M7 = step_time.ModelShape.of(Qwen2Config.preset("qwen2_5_7b"))


def test_role_shapes_split_the_games_over_samplers_and_the_rows_over_learners():
    sampler, learner = step_time.role_shapes(_seven_b(), 4)
    # 128 games over 4 hosts: 32 a host, one call of the 32 bucket; validation 16 x 16 rows / 4 = 64
    assert (sampler.hosts, sampler.chips, sampler.games_per_host, sampler.sampler_calls) == (4, 16, 32, 1)
    assert (sampler.val_games_per_host, sampler.val_sampler_calls) == (64, 1)
    # 12 learner hosts, 48 chips, FSDP 48 / tensor 4 = 12; 4 gradient rows a host -> 48; 128 / 12 -> 11 games a host
    assert (learner.hosts, learner.chips, learner.fsdp, learner.micro_batch_rows) == (12, 48, 12, 48)
    assert (learner.games_per_host, learner.sampler_calls, learner.val_every) == (11, 1, 0)
    # one sampler host plays all 128 games: the 128 bucket, one call
    one, _ = step_time.role_shapes(_seven_b(), 1)
    assert (one.games_per_host, one.sampler_calls) == (128, 1)
    # buckets up to 32: 128 games are four calls of 32
    capped, _ = step_time.role_shapes(_seven_b(batch_buckets=(8, 16, 32)), 1)
    assert (capped.games_per_host, capped.sampler_calls) == (32, 4)
    with pytest.raises(ValueError, match="sampler_hosts must be in"):
        step_time.role_shapes(_seven_b(), 16)
    with pytest.raises(ValueError, match="do not split evenly over 3"):
        step_time.role_shapes(_seven_b(), 3)


def test_the_weight_push_is_the_larger_of_a_sampler_chips_receipt_and_a_learner_chips_sends():
    p = M7.params
    # 4 sampler hosts: each chip receives its tensor shard 2P / 4; 16 sampler chips x P / 2 from 48 learner chips
    push = step_time.push_cost(M7, _seven_b(), 4, link_bytes_per_s=200e9)
    assert push["received_bytes_per_chip"] == pytest.approx(p / 2)
    assert push["sent_bytes_per_chip"] == pytest.approx(16 * p / 2 / 48)
    assert push["seconds"] == pytest.approx(p / 2 / 200e9)
    # 12 sampler hosts, 4 learner hosts: 48 x P / 2 sent by 16 chips = 1.5 P each, the larger
    push = step_time.push_cost(M7, _seven_b(), 12, link_bytes_per_s=100e9)
    assert push["seconds"] == pytest.approx(1.5 * p / 100e9)


def test_role_memory_counts_weights_moments_copies_and_the_kv_cache():
    sampler, learner = step_time.role_shapes(_seven_b(), 8)
    mem = step_time.role_memory(M7, sampler, learner)
    p, copy = M7.params, 2 * M7.params / 4
    assert mem["logprobs"] == pytest.approx(12 * p / 32 + 2 * copy)
    assert mem["gradient"] == pytest.approx(16 * p / 32 + copy)
    # 16 games x 2560 columns x bf16 K and V of 28 layers x 4 heads x 128 over 4 chips
    kv = 16 * 2560 * (2 * 28 * 4 * 128 * 2) / 4
    assert mem["sampler"] == pytest.approx(copy + kv)


def test_an_asynchronous_iteration_is_the_longer_role_plus_the_push():
    r = _seven_b()
    a = step_time.async_iteration(M7, r, V5E, 8)
    sampler, learner = step_time.role_shapes(r, 8)
    _, s = step_time.bound_stages(M7, sampler, V5E)
    _, lr = step_time.bound_stages(M7, learner, V5E)
    assert a["sampler_s"] == pytest.approx(s["rollout"] + s["validation"])
    assert a["learner_s"] == pytest.approx(lr["logprobs"] + lr["ppo_grad"] + lr["ppo_apply"] + lr["sync"])
    assert a["push_s"] == pytest.approx(M7.params / 2 / (V5E.ici_bandwidth / 2))
    assert a["iteration_s"] == pytest.approx(max(a["sampler_s"], a["learner_s"]) + a["push_s"])
    assert a["synchronous_s"] == pytest.approx(step_time.estimate(M7, r, V5E)["iteration_s"])
    assert a["speedup_async"] == pytest.approx(a["synchronous_s"] / a["iteration_s"])
    # 8 of 16 hosts learn: the same rows per chip in a micro-batch, twice the micro-batches (6400 rows / 32)
    counts, _ = step_time.bound_stages(M7, learner, V5E)
    assert counts["grad_micro_batches"] == 2 * step_time.bound_stages(M7, r, V5E)[0]["grad_micro_batches"] == 200
    flops = lambda shape: step_time.program_costs(M7, shape)["ppo_grad"].flops  # noqa: E731
    assert flops(learner) == pytest.approx(flops(r))
    # across slices the push goes over DCN: a host's 25 GB/s over its 4 chips
    d = step_time.async_iteration(M7, r, V5E, 8, dcn_bytes_per_s_per_host=25e9)
    assert d["push_s"] == pytest.approx(M7.params / 2 / (25e9 / 4))


def test_factors_scale_each_program_and_the_iteration_follows():
    r = _seven_b()
    _, floor = step_time.bound_stages(M7, r, V5E)
    _, twice = step_time.bound_stages(M7, r, V5E, dict.fromkeys(("prefill", "decode_step", "logprobs"), 2.0))
    assert twice["rollout"] == pytest.approx(2 * floor["rollout"])
    assert twice["validation"] == pytest.approx(2 * floor["validation"])
    assert twice["logprobs"] == pytest.approx(2 * floor["logprobs"])
    assert twice["ppo_grad"] == floor["ppo_grad"]
    cal = step_time.Calibration({"ppo_grad": 3.0, "ppo_apply": 3.0}, "test chip", "2026-12-04", "abc")
    e = step_time.expected(M7, r, V5E, cal)
    assert e["stages_s"]["ppo_grad"] == pytest.approx(3 * floor["ppo_grad"])
    assert e["iteration_s"] == pytest.approx(sum(floor.values()) + 2 * (floor["ppo_grad"] + floor["ppo_apply"]))
    assert e["run_hours"] == pytest.approx(150 * e["iteration_s"] / 3600)
    assert (e["device"], e["commit"]) == ("test chip", "abc")


def test_the_best_split_is_the_fastest_that_fits():
    r = _seven_b()
    b = step_time.best_split(M7, r, V5E)
    # the divisors of 128 games below 16 hosts; the learner's FSDP (its chips / tensor 4) must divide
    # the 3584 hidden size: 15 and 12 do not, 14 and 8 do
    assert [a["sampler_hosts"] for a in b["candidates"]] == [1, 2, 4, 8]
    assert [a["fsdp_divides_hidden"] for a in b["candidates"]] == [False, True, False, True]
    assert [a["fits"] for a in b["candidates"]] == [False, True, False, True]
    fastest = min((a for a in b["candidates"] if a["fits"]), key=lambda a: a["iteration_s"])
    assert b["best"]["sampler_hosts"] == fastest["sampler_hosts"]
    # a gradient activation that leaves room with 14 learner hosts only (8 hosts hold 16 P / 32 + a copy)
    p = M7.params
    room = 0.9 * V5E.hbm_bytes - (16 * p / 32 + p / 2)
    b = step_time.best_split(M7, r, V5E, headroom=dict(gradient=room + 1))
    assert [a["sampler_hosts"] for a in b["candidates"] if a["fits"]] == [2]
    assert b["best"]["sampler_hosts"] == 2
    assert step_time.best_split(M7, r, V5E, budget=0.01)["best"] is None


def test_the_committed_tables_are_generated_from_the_committed_reports():
    # README's pod and asynchronous tables and docs/pod.md's are launch.step_table's rendering of
    # benchmarks/step_time.json, which is the model of the committed AOT reports today
    import json
    import os

    from launch import step_table
    from launch._common import ROOT

    committed = json.load(open(os.path.join(ROOT, "benchmarks", "step_time.json")))
    rows = step_table.rows(
        os.path.join(ROOT, "benchmarks", "aot"), os.path.join(ROOT, "benchmarks", "shared_heads.json")
    )
    for new, old in zip(rows, committed["rows"], strict=True):
        for key in ("iteration_s_expected", "run_hours_expected", "chip_hours_expected"):
            assert new[key] == pytest.approx(old[key], rel=1e-9), (new["report"], key)
        a, b = new["async_schedule"], old["async_schedule"]
        assert a["best_expected"]["sampler_hosts"] == b["best_expected"]["sampler_hosts"]
        assert a["best_expected"]["iteration_s"] == pytest.approx(b["best_expected"]["iteration_s"], rel=1e-9)
        # the best split is no slower than any fitting candidate
        assert all(a["best_expected"]["iteration_s"] <= c["iteration_s_expected"] for c in a["candidates"] if c["fits"])
    with open(step_table.CALIBRATION) as f:
        cal = step_time.Calibration.from_report(json.load(f))
    assert committed["calibration"]["commit"] == cal.commit and committed["calibration"]["device"] == "NVIDIA H200"
    tables = step_table.tables(committed["rows"], cal)
    for doc, names in step_table.DOCS.items():
        text = open(os.path.join(ROOT, doc)).read()
        for name in names:
            assert step_table.replace_marked(text, name, tables[name]) == text, (doc, name)
    # 1.5B ALFWorld on 2 x v5e:4x4: one slice samples, the other learns, 1.34x the expected synchronous
    row = next(r for r in committed["rows"] if r["report"] == "alfworld_qwen2_5_1_5b__2xv5e-4x4.json")
    best = row["async_schedule"]["best_expected"]
    assert (best["sampler_hosts"], best["learner_hosts"], row["async_schedule"]["push_link"]) == (4, 4, "DCN")
    assert best["synchronous_s"] == pytest.approx(row["iteration_s_expected"])
    assert 1.25 < best["speedup_async"] < 1.45


def test_every_committed_slice_shows_its_splits_compiled_memory_per_role_within_the_budget():
    # issue 39: each row of the asynchronous table has `launch.aot --roles` memory per chip for the split it shows
    import json
    import os

    from launch._common import ROOT

    committed = json.load(open(os.path.join(ROOT, "benchmarks", "step_time.json")))
    for row in committed["rows"]:
        a = row["async_schedule"]
        best, aot = a["best_expected"], a["aot"]
        assert aot is not None, row["report"]
        assert aot["report"] == row["report"][:-5] + f"__roles-{best['sampler_hosts']}s{best['learner_hosts']}l.json"
        assert all(aot["fits"].values()) and all(aot[k]["fraction"] <= 0.9 for k in ("sampler", "learner", "push"))
        # roles on slices of their own push over DCN, as the row's model prices it
        assert a["push_link"] == ("DCN" if aot["role_topologies"] or row["slice"].startswith("2 x") else "ICI")


def test_replace_marked_names_missing_markers():
    from launch import step_table

    text = "a\n<!-- launch.step_table:x -->\nold\n<!-- /launch.step_table:x -->\nb"
    assert (
        step_table.replace_marked(text, "x", "new")
        == "a\n<!-- launch.step_table:x -->\nnew\n<!-- /launch.step_table:x -->\nb"
    )
    with pytest.raises(ValueError, match="no <!-- launch.step_table:y -->"):
        step_table.replace_marked(text, "y", "new")


def test_role_split_fields_are_unchanged_elsewhere():
    sampler, learner = step_time.role_shapes(_seven_b(), 4)
    keep = ("prompt_tokens", "response_tokens", "turns", "sampler_tensor", "tensor", "logprob_rows_per_host")
    for shape in (sampler, learner):
        assert all(getattr(shape, k) == getattr(_seven_b(), k) for k in keep)
        assert dataclasses.replace(shape) == shape


def test_role_report_reads_each_roles_largest_program(tmp_path):
    import json

    from launch import step_table

    (tmp_path / "x__v5e-4x4.json").write_text(json.dumps({"hosts": 4}))
    assert step_table.role_report(str(tmp_path), "x__v5e-4x4.json", 1) is None  # none committed

    def prog(total, frac):
        return {"total_bytes_per_chip": total, "fraction_of_hbm": frac}

    roles = {
        "sampler": {"prefill": prog(5, 0.3), "decode": prog(4, 0.25)},
        "learner": {"ppo_grad": prog(9, 0.55), "logprobs": prog(10, 0.6)},
        "push": {"push_gather": prog(3, 0.2)},
    }
    fits = {"sampler": True, "learner": True, "push": True}
    (tmp_path / "x__v5e-4x4__roles-1s3l.json").write_text(json.dumps({"roles": roles, "fits": fits}))
    r = step_table.role_report(str(tmp_path), "x__v5e-4x4.json", 1)
    assert r["report"] == "x__v5e-4x4__roles-1s3l.json" and r["fits"] == fits
    assert r["sampler"] == {"program": "prefill", "bytes": 5, "fraction": 0.3}
    assert r["learner"] == {"program": "logprobs", "bytes": 10, "fraction": 0.6}
    assert r["push"] == {"program": "push_gather", "bytes": 3, "fraction": 0.2} and r["role_topologies"] == {}
    assert not step_table.roles_apart(str(tmp_path), "x__v5e-4x4.json")
    # roles compiled on slices of their own: the push crosses the data-center network
    apart = {"roles": roles, "fits": fits, "role_topologies": {"sampler": "v5e:2x2", "learner": "v5e:2x4"}}
    (tmp_path / "x__v5e-4x4__roles-1s3l.json").write_text(json.dumps(apart))
    assert step_table.role_report(str(tmp_path), "x__v5e-4x4.json", 1)["role_topologies"]["learner"] == "v5e:2x4"
    assert step_table.roles_apart(str(tmp_path), "x__v5e-4x4.json")
