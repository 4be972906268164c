"""`launch.aot` at pod scale: disaggregated roles (``--roles``) and the packed learner programs.

Roles: a sampler group and a learner group of hosts compiled apart, with the weight push; the plans
and device split are checked on a v5e:4x4 topology description (libtpu, no compile), a tiny run
compiles a few programs of each role for it, and the committed role reports
(`benchmarks/aot/*__roles-*.json`) are checked always. Packed: the tiny default's packed gradient and
log-prob pass on 8 CPU devices.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLE_REPORTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "aot", "*__roles-*.json")))
REMAT_REPORTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "aot", "remat", "*.json")))
HOSTS = {"v5e:4x4": (4, 4), "v5e:8x8": (16, 4), "v5p:2x2x4": (4, 4)}  # topology -> (hosts, chips per host)
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs libtpu (pip install -e ".[tpu]")'
)
LIBTPU_ENV = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
MESH = {"mesh.data": 2, "mesh.fsdp": -1, "mesh.tensor": 4}  # tensor 4 = one v5e host's chips


def _tiny_spec(**overrides):
    import ml_collections

    from bipace_jax import build
    from configs import textcraft_tiny

    c = textcraft_tiny.get_config()
    for k, v in {**MESH, **overrides}.items():
        section, field = k.split(".")
        c[section][field] = v
    return build.build_spec(ml_collections.ConfigDict(c), num_devices=16, abstract=True)


def test_roles_are_parsed_and_must_cover_the_hosts():
    from bipace_jax.aot import parse_roles  # not launch.aot: its absl flags clash with launch.sweep's in one worker

    assert parse_roles("sampler:1,learner:3", 4) == 1
    assert parse_roles("learner:12,sampler:4", 16) == 4
    for bad in ("sampler:2", "sampler:2,learner:x", "sampler:2,learner:2,judge:1"):
        with pytest.raises(ValueError, match="expected sampler:S,learner:L"):
            parse_roles(bad, 4)
    with pytest.raises(ValueError, match="add up to the slice's 4 hosts"):
        parse_roles("sampler:2,learner:3", 4)
    with pytest.raises(ValueError, match="add up to the slice's 4 hosts"):
        parse_roles("sampler:0,learner:4", 4)


@needs_libtpu
def test_role_plans_split_the_task_groups_and_the_hosts_devices():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from bipace_jax import aot
    from bipace_jax import plan as plan_lib
    from bipace_jax.config import ConfigError

    devices = aot.topology_devices("v5e:4x4")
    spec = _tiny_spec()
    whole = plan_lib.plan(spec, plan_lib.HostLayout.of(spec, 4, 16, 4))
    sampler, learner = aot.role_plans(spec, whole, 1)
    # one sampler host plays all 8 task groups x 8 games: the 64-row bucket
    assert (sampler.hosts, sampler.games_per_host, sampler.sampler_batch) == (1, 64, 64)
    # 3 learner hosts, 12 chips: data 1 x fsdp 3 x tensor 4; 8 groups over 3 hosts -> 3 a host, 24 games
    lay = learner.layout
    assert (lay.processes, lay.devices, lay.mesh_shape) == (3, 12, (1, 3, 4))
    assert (learner.groups_per_host, learner.games_per_host, learner.estimator_rows) == (3, 24, 24 * 15)
    per_process = spec.learner.micro_batch_rows
    assert learner.micro_batch_rows_global == 3 * per_process
    assert learner.mini_batch_rows == whole.mini_batch_rows and learner.rows_per_iteration == whole.rows_per_iteration
    learn, samp = aot.role_devices(devices, 1)
    assert {d.process_index for d in learn} == {0, 1, 2} and {d.process_index for d in samp} == {3}
    assert len(learn) == 12 and len(samp) == 4
    with pytest.raises(ValueError, match="sampler hosts must be in"):
        aot.role_devices(devices, 4)
    # 4 task groups do not split over 3 sampler hosts
    odd = _tiny_spec(**{"rollout.num_groups": 4})
    odd_whole = plan_lib.plan(odd, plan_lib.HostLayout.of(odd, 4, 16, 4))
    with pytest.raises(ConfigError, match="rollout.num_groups"):
        aot.role_plans(odd, odd_whole, 3)


@pytest.mark.slow
@needs_libtpu
def test_a_tiny_disaggregated_run_compiles_each_role_and_the_push(tmp_path):
    args = [f"--config.{k}={v}" for k, v in MESH.items()] + ["--config.ppo.micro_batch_rows=1"]
    cmd = [
        sys.executable, "-m", "launch.aot", f"--out={tmp_path}", "--topology=v5e:4x4",
        "--roles=sampler:2,learner:2", "--programs=decode,ppo_apply,push_gather", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=LIBTPU_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # 2 + 2: libtpu numbers a program's devices from 0, and the first 3 hosts' chips of a v5e:4x4 carry
    # ids up to 13 (an all-reduce of a tensor-4 learner over them is refused; the 1.5B 1 + 3 compiles)
    r = json.load(open(tmp_path / "textcraft_tiny__v5e-4x4__roles-2s2l.json"))
    assert (r["sampler_hosts"], r["learner_hosts"]) == (2, 2)
    assert r["meshes"]["learner"] == {"data": 1, "fsdp": 2, "tensor": 4}
    assert r["meshes"]["sampler"] == {"data": 1, "fsdp": 1, "tensor": 4}
    # 8 task groups x 8 games over 2 sampler hosts: 32 a host, in the 64-row bucket; 1 gradient row a host
    assert r["shapes"]["sampler"]["sampler_batch"] == 64 and r["shapes"]["learner"]["micro_batch_rows"] == 2
    assert {k: set(v) for k, v in r["roles"].items()} == {
        "sampler": {"decode"},
        "learner": {"ppo_apply"},
        "push": {"push_gather"},
    }
    assert r["fits"] == {"sampler": True, "learner": True, "push": True}
    # nothing but the sampler's own arguments lives on a sampler host
    assert r["roles"]["sampler"]["decode"]["other_resident_bytes"] == 0
    # the update reads fp32 parameters, gradients and both moments split over the 8 learner chips
    res = r["resident_bytes_per_chip"]["learner"]
    apply = r["roles"]["learner"]["ppo_apply"]
    assert apply["argument_bytes"] >= 2 * res["params"] + res["opt_state"] > 0
    # the push: one all-gather over the whole slice, beside every array of a learner chip
    push = r["roles"]["push"]["push_gather"]
    assert push["collectives"]["all-gather"] >= 1
    assert push["other_resident_bytes"] == sum(res.values())
    st = r["step_time"]
    assert st["iteration_s"] == pytest.approx(max(st["sampler_s"], st["learner_s"]) + st["push_s"])


def test_role_slices_must_hold_each_roles_hosts_of_the_slices_chips():
    from types import SimpleNamespace

    from bipace_jax.aot import role_slices

    def chips(hosts, per_host=4, kind="TPU v5 lite"):
        return [SimpleNamespace(process_index=h, device_kind=kind) for h in range(hosts) for _ in range(per_host)]

    whole = chips(16)
    role_slices(whole, 2, chips(2), chips(14))  # v5e:8x8 as v5e:2x4 + v5e:4x14
    with pytest.raises(ValueError, match=r"the sampler slice must be 2 hosts of 4 x TPU v5 lite, got 1 hosts, 4 x"):
        role_slices(whole, 2, chips(1), chips(14))
    with pytest.raises(ValueError, match=r"the learner slice must be 14 hosts"):
        role_slices(whole, 2, chips(2), chips(16))
    with pytest.raises(
        ValueError, match=r"the learner slice must be 14 hosts of 4 x TPU v5 lite, got 14 hosts, 56 x TPU v5"
    ):
        role_slices(whole, 2, chips(2), chips(14, kind="TPU v5"))


@pytest.mark.slow
@needs_libtpu
def test_roles_on_slices_of_their_own_push_over_the_data_center_network(tmp_path):
    from bipace_jax import step_time

    args = [f"--config.{k}={v}" for k, v in MESH.items()] + ["--config.ppo.micro_batch_rows=1"]
    cmd = [
        sys.executable, "-m", "launch.aot", f"--out={tmp_path}", "--topology=v5e:4x4", "--roles=sampler:2,learner:2",
        "--programs=ppo_apply,push_gather", *args,
    ]  # fmt: skip
    bad = subprocess.run([*cmd, "--role_topologies=v5e:2x2,v5e:2x4"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=LIBTPU_ENV)  # fmt: skip
    assert bad.returncode != 0 and "the sampler slice must be 2 hosts of 4 x TPU v5 lite, got 1 hosts" in bad.stderr
    proc = subprocess.run([*cmd, "--role_topologies=v5e:2x4,v5e:2x4"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=LIBTPU_ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__v5e-4x4__roles-2s2l.json"))
    assert r["role_topologies"] == {"sampler": "v5e:2x4", "learner": "v5e:2x4"} and r["push_link"] == "DCN"
    # the push's compiled part gathers over the learner slice alone, beside a learner chip's arrays
    assert r["meshes"]["push"] == r["meshes"]["learner"] == {"data": 1, "fsdp": 2, "tensor": 4}
    push = r["roles"]["push"]["push_gather"]
    assert push["other_resident_bytes"] == sum(r["resident_bytes_per_chip"]["learner"].values())
    assert r["fits"] == {"sampler": True, "learner": True, "push": True}
    # its time: a sampler chip's tensor shard of the bf16 model at a host's DCN share (25 GB/s / 4 chips)
    st = r["step_time"]
    want = 2 * r["model"]["params"] / 4 / (step_time.DCN_BYTES_PER_S_PER_HOST / 4)
    assert st["push_s"] == pytest.approx(want, rel=1e-2)


@pytest.mark.parametrize("path", ROLE_REPORTS, ids=[os.path.basename(p) for p in ROLE_REPORTS])
def test_committed_role_reports_fit_each_role_within_the_budget(path):
    r = json.load(open(path))
    assert set(r["roles"]) == {"sampler", "learner", "push"} and all(r["fits"].values())
    assert r["sampler_hosts"] + r["learner_hosts"] == r["hosts"]
    assert f"__roles-{r['sampler_hosts']}s{r['learner_hosts']}l" in os.path.basename(path)
    budget = r["budget_fraction"] * r["hbm_bytes_per_chip"]
    for role, progs in r["roles"].items():
        for name, p in progs.items():
            assert p["total_bytes_per_chip"] == p["peak_bytes_per_chip"] + p["other_resident_bytes"], (role, name)
            assert p["total_bytes_per_chip"] <= budget, (role, name)
    assert {"ppo_grad", "ppo_apply", "logprobs"} <= set(r["roles"]["learner"])
    assert {"prefill", "decode"} <= set(r["roles"]["sampler"])
    # the learner's mesh is its hosts' chips, FSDP over them
    m = r["meshes"]["learner"]
    assert m["data"] * m["fsdp"] * m["tensor"] == r["learner_hosts"] * r["chips"] // r["hosts"]
    # roles on slices of their own: the push gathers over the learner slice and crosses DCN
    if r.get("role_topologies"):
        assert r["meshes"]["push"] == m and r["push_link"] == "DCN"
        push = r["step_time"]["push"]
        link = 25e9 / (r["chips"] // r["hosts"])  # a host's DCN share a chip
        assert push["seconds"] == pytest.approx(
            max(push["received_bytes_per_chip"], push["sent_bytes_per_chip"]) / link
        )


@pytest.mark.slow
def test_the_packed_learner_programs_compile_at_the_pack_widths(tmp_path):
    mesh = ["--config.mesh.data=1", "--config.mesh.fsdp=-1"]
    # a line holds the longest row (448 + 32 tokens); the CPU default packs, so the padded program needs pack=False
    widths = ["--config.ppo.pack_width=512", "--config.ppo.pack_response_width=96", "--config.ppo.pack=False"]
    cmd = [sys.executable, "-m", "launch.aot", f"--out={tmp_path}", "--topology=cpu:8", *mesh, *widths]
    proc = subprocess.run(
        [*cmd, "--programs=ppo_grad,ppo_grad_packed,logprobs_packed"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__cpu-8.json"))
    assert set(r["programs"]) == {"ppo_grad", "ppo_grad_packed", "logprobs_packed"} and r["fits"] is True
    sh = r["shapes"]
    assert (sh["pack"], sh["pack_width"], sh["pack_response_width"]) == (False, 512, 96)
    # 8 lines a host x 512 tokens against 8 rows x (448 + 32), and 96 response slots a line against 32 a row
    # at the LM head (and, on CPU, the last layer): a compiled micro-batch of lines does a little more work
    # than one of rows (1.17x here; ~0.6x if the lines were compiled at another width); packing saves whole
    # micro-batches, which the run's plan counts, not the compile
    g, pg = r["programs"]["ppo_grad"]["flops"], r["programs"]["ppo_grad_packed"]["flops"]
    assert 1.0 < pg / g < 1.35
    # with ppo.pack on, ppo_grad is the packed program itself, into the run's report
    proc = subprocess.run(
        [*cmd, "--config.ppo.pack=True", "--programs=ppo_grad"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    packed = json.load(open(tmp_path / "textcraft_tiny__cpu-8.json"))
    assert packed["shapes"]["pack"] is True
    assert packed["programs"]["ppo_grad"]["flops"] == pytest.approx(pg, rel=1e-6)


def test_choose_remat_takes_the_least_recompute_that_fits():
    from bipace_jax.aot import choose_remat

    totals = {"none": 12, "save_dots": 9, "full": 7}
    assert choose_remat(totals, 12) == "none"
    assert choose_remat(totals, 11.9) == "save_dots"
    assert choose_remat(totals, 8) == "full"
    assert choose_remat(totals, 6) is None
    assert choose_remat({"full": 7, "none": 12}, 10) == "full"  # save_dots not compiled: skipped


@pytest.mark.slow
def test_the_remat_search_compiles_the_gradient_under_each_policy(tmp_path):
    # a scanned 4-layer tiny model (remat inside the scan survives XLA's CSE), 16 rows a micro-batch
    args = [
        "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.model.num_layers=4",
        "--config.model.scan_layers=True", "--config.ppo.micro_batch_rows=16", "--programs=ppo_apply",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "launch.aot", f"--out={tmp_path}", "--topology=cpu:8", "--remat_search", *args]
    # model.remat=auto: the plan resolves it at the devices' memory (a CPU device's share of this machine's)
    proc = subprocess.run([*cmd, "--config.model.remat=auto"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.load(open(tmp_path / "textcraft_tiny__cpu-8.json"))
    auto, r = report["remat_auto"], report["remat_search"]
    assert auto["resolved"] == report["model"]["remat"] == "none" and "model.remat=auto -> none" in proc.stdout
    assert auto["cutoff_bytes"] == pytest.approx(0.8 * report["hbm_bytes_per_chip"])
    # the estimate orders the policies as the compile does, and picks what the compile picks
    est = {k: v["bytes_per_chip"] for k, v in r["estimate"].items()}
    assert est == {k: int(v) for k, v in auto["bytes"].items()} and est["none"] > est["save_dots"] > est["full"]
    assert r["estimate_chosen"] == r["chosen"] == "none" and r["estimate_matches_compile"]
    alone = json.load(open(tmp_path / "remat" / "textcraft_tiny__cpu-8.json"))
    assert alone["chosen"] == "none" and alone["policies"] == r["policies"] and alone["topology"] == "cpu:8"
    p = r["policies"]
    # less kept, more recomputed: temporaries fall and FLOPs rise from none to save_dots to full
    assert p["none"]["temp_bytes"] > p["save_dots"]["temp_bytes"] > p["full"]["temp_bytes"]
    assert p["none"]["flops"] < p["save_dots"]["flops"] < p["full"]["flops"]
    assert p["none"]["total_bytes_per_chip"] > p["full"]["total_bytes_per_chip"]
    assert r["configured"] == "none" and r["chosen"] == "none"  # everything fits the tiny model
    # a budget between full's and none's totals picks the least recompute under it
    hbm = json.load(open(tmp_path / "textcraft_tiny__cpu-8.json"))["hbm_bytes_per_chip"]
    budget = (p["full"]["total_bytes_per_chip"] + 1) / hbm
    proc = subprocess.run([*cmd, f"--budget={budget}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.load(open(tmp_path / "textcraft_tiny__cpu-8.json"))["remat_search"]
    want = "save_dots" if r["policies"]["save_dots"]["total_bytes_per_chip"] <= budget * hbm else "full"
    assert r["chosen"] == want


@pytest.mark.parametrize("path", REMAT_REPORTS, ids=[os.path.basename(p) for p in REMAT_REPORTS])
def test_committed_remat_searches_agree_with_the_plans_estimate(path):
    # `launch.aot --remat_search` on a paper slice: the compile's choice, and model.remat="auto"'s (the
    # plan's estimate, recomputed here without compiling) beside it
    import dataclasses

    from bipace_jax import build
    from bipace_jax import plan as plan_lib

    r = json.load(open(path))
    c = importlib.import_module(f"configs.{r['config']}").get_config()
    for k, v in r["overrides"].items():
        section, field = k.split(".")
        c[section][field] = int(v)
    hosts, per_host = HOSTS[r["topology"]]
    hosts *= r["num_slices"]  # slices joined over DCN: their hosts together
    spec = build.build_spec(c, num_devices=hosts * per_host, abstract=True)
    full = dataclasses.replace(spec, model=dataclasses.replace(spec.model, remat="full"))
    p = plan_lib.plan(full, plan_lib.HostLayout.of(full, hosts, hosts * per_host, per_host))
    est = plan_lib.remat_estimate(full, p)
    assert {k: int(v) for k, v in est.items()} == {k: v["bytes_per_chip"] for k, v in r["estimate"].items()}
    assert plan_lib.resolve_remat(est, r["hbm_bytes_per_chip"]) == r["estimate_chosen"]
    # the compile's choice: the least recompute that compiled within the budget
    budget = r["budget_fraction"]
    fits = [k for k, v in r["policies"].items() if v["compiles"] and v["fraction_of_hbm"] <= budget]
    assert r["chosen"] == fits[0] and r["estimate_matches_compile"] == (r["chosen"] == r["estimate_chosen"])
    # less kept, more recomputed: FLOPs rise from policy to policy among those that compiled
    flops = [v["flops"] for v in r["policies"].values() if v["compiles"]]
    assert flops == sorted(flops)
