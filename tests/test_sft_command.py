"""`python -m launch.sft` (`bipace_jax.sft.run`) end to end, scaled down to CI size.

The scaled-down run exercises every stage of the command (tokenizer build, oracle data, BC, a DAgger
round through `rollout.collect`, validation, checkpoints, HF export) and checks that (1) two runs with
the same seed write bitwise-identical weights; (2) the tokenizer it builds is exactly the shipped one
(same `tokenizer.json` vocabulary and merges); (3) the exported folder loads with `load_hf_checkpoint`
and holds the checkpointed weights; (4) a run killed during its last round resumes from the saved round
and ends with the same weights as an uninterrupted one. The shipped weights themselves are played in
`tests/test_tiny_shipped.py`.
"""

import json
import os

import numpy as np
import pytest

from tests.tiny_runs import TINY_ACTOR, TINY_ACTOR_FLAGS

pytestmark = pytest.mark.e2e

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "bipace_jax", "data", "textcraft_tiny")


def small_config():
    from configs.sft_textcraft_tiny import get_config

    c = get_config()
    c.model.update(TINY_ACTOR)  # the RL tests' random tiny actor
    c.env.max_steps = 3
    c.data.expert_seeds = 1
    c.data.length_buckets = (384,)
    c.sampler.length_buckets = (384,)
    c.sampler.batch_buckets = (8,)
    c.sampler.max_new_tokens = 24
    c.train.batch_size = 4
    c.train.bc_steps = 3
    c.train.steps_per_round = 2
    c.optim.warmup_steps = 1
    c.train.log_every = 1
    c.dagger.rounds = 1
    c.dagger.episodes = 4
    c.val.num_tasks = 3
    c.val.num_holdout_tasks = 1
    c.val.seeds_per_goal = 1
    c.val.every_round = False
    c.env.num_workers = 2
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from bipace_jax.sft import run

    out = []
    for k in range(2):
        work = tmp_path_factory.mktemp(f"sft{k}")
        report = run(small_config(), str(work / "w"), str(work / "hf"), progress=False)
        out.append((work, report))
    return out


def test_a_finished_warm_start_keeps_its_config_and_refuses_a_changed_one(runs):
    from bipace_jax import resume
    from bipace_jax.sft import run

    work, report = runs[0]
    assert json.loads((work / "w" / "config.json").read_text()) == json.loads(small_config().to_json_best_effort())
    c = small_config()
    c.train.bc_steps = 4
    with pytest.raises(resume.ConfigChangeError) as e:
        run(c, str(work / "w"), progress=False)
    assert str(e.value) == (
        f"--workdir={work / 'w'} holds a run ({report['updates']} updates) with another config: "
        "config.train.bc_steps: 3 -> 4; use a new --workdir, or --allow_config_change to continue it"
    )


def test_same_seed_gives_bitwise_identical_weights(runs):
    from safetensors.numpy import load_file

    a = load_file(str(runs[0][0] / "hf" / "model.safetensors"))
    b = load_file(str(runs[1][0] / "hf" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_report_has_validation_by_depth_and_heldout_and_metrics_are_logged(runs):
    work, report = runs[0]
    f = report["final_val"]  # RL's validation record (validation.panel_record) of the seen and held-out panels
    assert f["val/tasks"] + f["val/holdout/tasks"] == 4 and 0.0 <= f["val/success_rate"] <= 1.0
    assert any(k.startswith("val/success_rate/depth_") for k in f) and "val/holdout/success_rate" in f
    assert report["expert_examples"] > 0 and report["dagger_examples"] > 0
    # the DAgger round's states are records in the run folder: the examples and the too-long ones
    from bipace_jax import demos

    records = demos.read_records(work / "w" / "dagger_0.jsonl", demos.FIELDS + demos.DAGGER_FIELDS)
    r0 = report["rounds"][0]
    assert (
        len(records) == r0["dagger/new_examples"] + r0["dagger/too_long"]
        and r0["dagger/new_examples"] == report["dagger_examples"]
    )
    assert {r["round"] for r in records} == {0} and not (work / "w" / "dagger_0.json").exists()
    lines = [json.loads(x) for x in open(work / "w" / "metrics.jsonl")]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert len(losses) == 5 and all(np.isfinite(losses))
    assert any(x.startswith("events") for x in os.listdir(work / "w" / "tb"))


def test_exported_folder_loads_and_holds_the_checkpointed_weights(runs):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bipace_jax import learner, sft
    from bipace_jax.checkpointing import Checkpointer
    from bipace_jax.models import load_hf_checkpoint, load_tokenizer

    work, report = runs[0]
    actor = load_hf_checkpoint(str(work / "hf"))
    tok = load_tokenizer(str(work / "hf" / "tokenizer"))
    trained = load_tokenizer(str(work / "w" / "tokenizer"))
    text = "craft 1 stick using 2 oak planks\nInventory: [oak planks] (2)"
    assert tok(text)["input_ids"] == trained(text)["input_ids"]  # exported = trained tokenization
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Goal: craft stick."}], tokenize=False, add_generation_prompt=True
    )
    ids = jnp.asarray([tok(ids, add_special_tokens=False)["input_ids"]], jnp.int32)
    logits = actor(ids, jnp.ones_like(ids)).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert tok.eos_token == "<|im_end|>" and actor.config.eos_token_ids == (tok.eos_token_id,)
    # the checkpoint of the last round holds the same weights and the update count
    params = nnx.state(actor, nnx.Param)
    ckpt = Checkpointer(str(work / "w"))
    assert ckpt.latest_step() == 1
    spec = sft.build_warm_start(small_config())
    got, _, _, meta = ckpt.restore(1, params, learner.make_optimizer(spec.optim, spec.total_updates).init(params))
    assert meta["updates"] == report["updates"] == 5
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_command_builds_exactly_the_shipped_tokenizer(runs):
    if not os.path.exists(os.path.join(SHIPPED, "tokenizer.json")):
        pytest.skip("no shipped warm start in this checkout")
    built = json.load(open(runs[0][0] / "w" / "tokenizer" / "tokenizer.json"))
    shipped = json.load(open(os.path.join(SHIPPED, "tokenizer", "tokenizer.json")))
    assert built["model"]["vocab"] == shipped["model"]["vocab"]
    assert built["model"]["merges"] == shipped["model"]["merges"]
    assert built["added_tokens"] == shipped["added_tokens"]


def test_a_run_killed_in_its_last_round_resumes_to_the_same_weights(runs, tmp_path):
    """Round 1's checkpoint removed (a kill before it committed): the rerun trains round 1 again from
    round 0's checkpoint and its DAgger data, and ends bitwise where the uninterrupted run did."""
    import shutil

    from safetensors.numpy import load_file

    from bipace_jax.sft import run

    work, _ = runs[1]
    shutil.rmtree(work / "w" / "checkpoints" / "1")
    report = run(small_config(), str(work / "w"), str(tmp_path / "hf"), progress=False)
    assert [r["round"] for r in report["rounds"]] == [1] and report["updates"] == 5
    assert report["dagger_examples"] == runs[0][1]["dagger_examples"]
    a = load_file(str(runs[0][0] / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # metrics: one line per update of the final history, the re-run round's lines replacing the lost ones
    lines = [json.loads(x) for x in open(work / "w" / "metrics.jsonl")]
    assert [x["iteration"] for x in lines if "train/loss" in x] == [1, 2, 3, 4, 5]
    # a finished run resumes past its last round: nothing is retrained
    report = run(small_config(), str(work / "w"), None, progress=False)
    assert report["rounds"] == [] and report["updates"] == 5


def _launch_args(work, out, tokenizer=""):
    """``python -m launch.sft`` at CI size: 24 BC updates of 4 examples inside the first epoch (~200
    examples), a checkpoint every 4 updates, one DAgger round of 4 games and 4 more updates."""
    import sys

    over = dict(
        model_tokenizer=tokenizer,
        env_max_steps=3,
        env_num_workers=1,
        data_expert_seeds=1,
        data_length_buckets="(384,)",
        sampler_length_buckets="(384,)",
        sampler_batch_buckets="(8,)",
        sampler_max_new_tokens=24,
        train_batch_size=4,
        train_bc_steps=24,
        train_steps_per_round=4,
        train_log_every=1,
        train_checkpoint_every=4,
        train_log_examples=True,
        optim_warmup_steps=1,
        dagger_rounds=1,
        dagger_episodes=4,
        val_num_tasks=3,
        val_num_holdout_tasks=1,
        val_seeds_per_goal=1,
    )
    flags_ = [f"--config.{k.replace('_', '.', 1)}={v}" for k, v in over.items()]
    return [
        sys.executable,
        "-m",
        "launch.sft",
        "--config=configs/sft_textcraft_tiny.py",
        f"--workdir={work}",
        f"--out={out}",
        "--progress=False",
        *TINY_ACTOR_FLAGS,  # the warm start's random actor: the RL tests' tiny one
        *flags_,
    ]


def _examples_seen(work):
    return [json.loads(x) for x in open(os.path.join(work, "examples.jsonl"))]


def test_a_warm_start_killed_mid_epoch_resumes_on_the_next_example(tmp_path):
    """`python -m launch.sft` SIGKILLed inside its first epoch of BC (after a checkpoint inside the round),
    then the same command again: the examples of every update, in order, are an uninterrupted run's (none
    repeated, none skipped), and so are the final weights."""
    import signal
    import subprocess
    import time

    from safetensors.numpy import load_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)

    def launch(work, out, tokenizer=""):
        err = open(f"{work}.stderr", "a")  # a file, not a pipe nobody reads while the run is watched
        return subprocess.Popen(_launch_args(work, out, tokenizer), cwd=root, env=env, stdout=err, stderr=err)

    def tail(work):
        return open(f"{work}.stderr").read()[-3000:]

    whole = launch(tmp_path / "a", tmp_path / "a_hf")
    assert whole.wait(timeout=900) == 0, tail(tmp_path / "a")
    ref = _examples_seen(tmp_path / "a")
    tok = str(tmp_path / "a" / "tokenizer")  # the killed run reuses it (the tokenizer build is not under test)

    killed, log = launch(tmp_path / "b", tmp_path / "b_hf", tok), tmp_path / "b" / "examples.jsonl"
    deadline = time.time() + 600
    while killed.poll() is None and time.time() < deadline:  # past update 6: a checkpoint at 4, updates after it
        if log.exists() and len(log.read_text().splitlines()) >= 6:
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert killed.wait(timeout=60) == -signal.SIGKILL, tail(tmp_path / "b")
    cut = _examples_seen(tmp_path / "b")
    assert 6 <= len(cut) < 24 and cut == ref[: len(cut)]  # killed inside round 0 (BC), mid-epoch
    ckpts = tmp_path / "b" / "checkpoints"
    latest = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists())
    meta = json.loads((ckpts / str(latest) / "meta" / "metadata").read_text())
    pos = meta["data_stream"]  # the resume starts inside round 0, from the stream's saved position
    assert meta["iteration"] == 0 and pos["round_updates"] == meta["updates"] >= 4 and pos["examples"] == 210

    resumed = launch(tmp_path / "b", tmp_path / "b_hf", tok)
    assert resumed.wait(timeout=900) == 0, tail(tmp_path / "b")
    got = _examples_seen(tmp_path / "b")
    assert [x["update"] for x in got] == list(range(1, 29))  # each update once: none repeated, none skipped
    assert got == ref
    bc = [k for x in got if x["round"] == 0 for k in x["examples"]]
    assert len(bc) == 24 * 4 == len(set(bc))  # BC stays inside the first epoch: no example twice
    a, b = (
        load_file(str(tmp_path / "a_hf" / "model.safetensors")),
        load_file(str(tmp_path / "b_hf" / "model.safetensors")),
    )
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
