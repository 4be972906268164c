"""Run state that must survive crashes: checkpoints, metrics lines, task order, validation panel."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bipace_jax import metric_keys as keys
from bipace_jax.checkpointing import Checkpointer, CheckpointMeta
from bipace_jax.config import ConfigError, resolve_template, validate_selector
from bipace_jax.metrics import MetricsLogger, read_metrics
from bipace_jax.plots import make_plots
from bipace_jax.stats import StageTimer, panel_metrics
from bipace_jax.tasks import TRAIN_SEED_RANGE, select_tasks, split_holdout, train_task, validation_panel


def _tree():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones(4, jnp.bfloat16)}}
    opt = optax.adamw(1e-3).init(params)
    return params, opt


def test_checkpoint_round_trip_restores_every_field(tmp_path):
    params, opt = _tree()
    params2 = jax.tree.map(lambda x: x + 1, params)
    _, opt2 = optax.adamw(1e-3).update(params, opt, params)
    ck = Checkpointer(str(tmp_path), keep=2)
    assert ck.latest_step() is None
    ck.save(1, params, opt, jax.random.PRNGKey(1), {"iteration": 1, "task_cursor": 16, "epsilon": 0.05})
    ck.save(
        2,
        params2,
        opt2,
        jax.random.PRNGKey(7),
        {"iteration": 2, "task_cursor": 32, "epsilon": 0.07, "controller": {"epsilon": 0.07}},
    )
    ck.save(3, params2, opt2, jax.random.PRNGKey(9), {"iteration": 3, "task_cursor": 48, "epsilon": 0.08})
    assert ck.all_steps() == [2, 3]  # keep=2
    p, o, rng, meta = Checkpointer(str(tmp_path)).restore(2, params, opt)
    jax.tree.map(np.testing.assert_array_equal, p, params2)
    jax.tree.map(np.testing.assert_array_equal, o, opt2)
    assert p["b"]["c"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(rng, jax.random.PRNGKey(7))
    assert (meta["iteration"], meta["task_cursor"], meta["epsilon"], meta["controller"]) == (
        2,
        32,
        0.07,
        {"epsilon": 0.07},
    )
    with pytest.raises(FileNotFoundError, match="no checkpoint step 1"):
        ck.restore(1, params, opt)


def test_half_written_checkpoint_is_not_the_latest(tmp_path):
    params, opt = _tree()
    ck = Checkpointer(str(tmp_path))
    ck.save(1, params, opt, jax.random.PRNGKey(0), {"iteration": 1, "task_cursor": 0, "epsilon": 0.05})
    # what a process killed mid-save leaves behind: orbax's temporary folder, never renamed
    os.makedirs(tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp" / "state")
    assert Checkpointer(str(tmp_path)).latest_step() == 1


def test_metrics_logger_drops_lines_of_iterations_that_will_be_rerun(tmp_path):
    m = MetricsLogger(str(tmp_path), start_iteration=0)
    for i in range(3):
        m.write(i, {"train/success_rate": 0.1 * i, "val/success_rate": float("nan") if i == 1 else 0.5})
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "train/succ')  # cut by a kill mid-write
    m = MetricsLogger(str(tmp_path), start_iteration=2)
    m.write(2, {"train/success_rate": 0.9})
    m.close()
    rows = read_metrics(str(tmp_path))
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[2]["train/success_rate"] == 0.9 and rows[1]["val/success_rate"] is None
    paths = make_plots(str(tmp_path), grouping="obs_hash")
    # no PACE rows and no epsilon recorded: no PACE mix and no calibration plot (tests/test_plots.py)
    assert [os.path.basename(p) for p in paths] == [
        "success.png",
        "singleton_rate.png",
        "training.png",
        "time.png",
        "categories.png",
    ]


def test_task_selectors():
    info = lambda i: {"depth": 2 + i % 3}
    assert select_tasks("all", 5, info) == [0, 1, 2, 3, 4]
    assert select_tasks("1:4", 9, info) == [1, 2, 3]
    assert select_tasks("7,2,2", 9, info) == [2, 7]
    assert select_tasks("depth=3,4", 6, info) == [1, 2, 4, 5]
    assert select_tasks("depth=2&0:4", 9, info) == [0, 3]
    assert select_tasks("", 9, info) == []
    with pytest.raises(ValueError, match="ids \\[12\\] outside"):
        select_tasks("1,12", 9, info)
    with pytest.raises(ValueError, match="matches no task"):
        select_tasks("depth=9", 9, info)
    # One grammar: the config check and the selection reject the same malformed part.
    with pytest.raises(ValueError, match="part 'depth>2' is not"):
        select_tasks("0:4&depth>2", 9, info)
    with pytest.raises(ConfigError, match="config.tasks.train must be a task selector"):
        validate_selector("tasks.train", "0:4&depth>2", allow_empty=False)
    validate_selector("tasks.holdout", "", allow_empty=True)
    with pytest.raises(ConfigError, match="config.tasks.train must be a non-empty task selector"):
        validate_selector("tasks.train", "", allow_empty=False)


def test_training_task_order_visits_every_task_once_per_epoch_and_is_reproducible():
    ids = [3, 5, 8, 13, 21]
    first = [train_task(ids, 0, i) for i in range(10)]
    assert sorted(t for t, _ in first[:5]) == ids and sorted(t for t, _ in first[5:]) == ids
    assert first == [train_task(ids, 0, i) for i in range(10)]
    assert [t for t, _ in first] != [t for t, _ in (train_task(ids, 1, i) for i in range(10))]
    assert all(0 <= s < TRAIN_SEED_RANGE for _, s in first)


def test_holdout_every_kth_goal_of_the_set():
    train, held = split_holdout(list(range(10, 30)), [11], 8)
    assert held == [11, 17, 25] and train == [t for t in range(10, 30) if t not in (11, 17, 25)]
    assert split_holdout([3, 1, 2], [], 0) == ([1, 2, 3], [])


def test_spread_validation_panel_is_evenly_spaced_with_consecutive_unseen_seeds():
    seen, held = validation_panel(list(range(100, 170)), [7, 8, 9], 5, 16, 1_000_000, "spread")
    # linspace(0, 69, 5) = 0, 17.25, 34.5, 51.75, 69 -> rounded half to even: 0, 17, 34, 52, 69
    assert seen == [(100, 1_000_000), (117, 1_000_001), (134, 1_000_002), (152, 1_000_003), (169, 1_000_004)]
    assert held == [(7, 1_000_005), (8, 1_000_006), (9, 1_000_007)]  # all of them when fewer


def test_panel_goals_can_be_played_with_several_unseen_seeds_each():
    seen, held = validation_panel([100, 101, 102], [7], 2, 1, 1_000_000, "spread", seeds_per_goal=3)
    assert seen == [
        (100, 1_000_000),
        (100, 1_000_001),
        (100, 1_000_002),
        (102, 1_000_003),
        (102, 1_000_004),
        (102, 1_000_005),
    ]
    assert held == [(7, 1_000_006), (7, 1_000_007), (7, 1_000_008)]
    seen, held = validation_panel(list(range(40)), [50], 4, 1, 1_000_003, "random", seeds_per_goal=2)
    assert len(seen) == 8 and len({t for t, _ in seen}) == 4 and len({s for _, s in seen + held}) == 10
    assert [t for t, _ in seen][::2] == [t for t, _ in seen][1::2]


def test_random_validation_panel_is_fixed_with_unseen_seeds():
    ids = list(range(40))
    seen, held = validation_panel(ids, [50, 51], 8, 1, 1_000_003, "random")
    assert (seen, held) == validation_panel(ids, [50, 51], 8, 1, 1_000_003, "random")
    assert len({t for t, _ in seen}) == 8 and len(held) == 1 and held[0][0] in (50, 51)
    assert all(s >= TRAIN_SEED_RANGE for _, s in seen + held)
    assert validation_panel(ids, [], 0, 4, 1_000_000, "random") == ([], [])


def test_prompt_template_from_json_or_reference():
    assert resolve_template("") is None
    assert resolve_template('{"task_echo": "start"}') == {"task_echo": "start"}
    assert resolve_template("configs.textcraft_tasks:TEMPLATE")["task_echo"] == "start"
    with pytest.raises(ConfigError, match="config.rollout.template must name"):
        resolve_template("bipace_jax.config:NOPE")


def _two_checkpoints(tmp_path):
    params, opt = _tree()
    ck = Checkpointer(str(tmp_path), keep=5)
    for step in (1, 2):
        ck.save(step, jax.tree.map(lambda x, s=step: x + s, params), opt, jax.random.PRNGKey(step), {"iteration": step})
    return ck, params, opt


def test_a_step_whose_save_never_committed_is_set_aside_and_the_previous_one_restores(tmp_path, caplog):
    import shutil

    ck, params, opt = _two_checkpoints(tmp_path)
    shutil.copytree(os.path.join(ck.directory, "2"), os.path.join(ck.directory, "4"))
    os.remove(os.path.join(ck.directory, "4", "commit_success.txt"))
    assert ck.latest_step() == 4  # orbax lists the uncommitted folder as a step
    with caplog.at_level("WARNING"):
        step, (p, _, rng, meta) = ck.restore_latest(params, opt)
    assert step == 2 and meta["iteration"] == 2
    np.testing.assert_array_equal(p["w"], params["w"] + 2)
    assert any("step 4" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert ck.all_steps() == [1, 2] and os.path.isdir(os.path.join(ck.directory, "torn", "4.0"))
    ck.save(4, params, opt, jax.random.PRNGKey(4), {"iteration": 4})  # the same step saves again
    assert ck.restore_latest(params, opt)[0] == 4


def test_a_truncated_data_file_makes_the_newest_step_fall_back(tmp_path, caplog):
    import glob
    import shutil

    ck, params, opt = _two_checkpoints(tmp_path)
    shutil.copytree(os.path.join(ck.directory, "2"), os.path.join(ck.directory, "4"))
    data = [
        f
        for f in glob.glob(os.path.join(ck.directory, "4", "state", "**", "*"), recursive=True)
        if os.path.isfile(f) and os.path.getsize(f) > 64 and "/d/" in f
    ]
    assert data
    for f in data:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    with caplog.at_level("WARNING"):
        step, (p, *_rest) = ck.restore_latest(params, opt)
    assert step == 2 and any("step 4" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(p["w"], params["w"] + 2)
    assert ck.restore_latest(params, opt)[0] == 2  # the torn step stays set aside


def test_two_metrics_loggers_started_in_the_same_second_keep_both_event_files(tmp_path):
    first = MetricsLogger(str(tmp_path))
    first.write(0, {"x": 1.0})
    first.close()
    second = MetricsLogger(str(tmp_path), start_iteration=1)
    second.write(1, {"x": 2.0})
    second.close()
    files = sorted(os.listdir(tmp_path / "tb"))
    assert len(files) == 2 and len(set(files)) == 2
    import struct

    from tensorboardX.proto import event_pb2

    steps = []
    for f in files:  # TFRecord framing: uint64 length, uint32 crc, payload, uint32 crc
        data = (tmp_path / "tb" / f).read_bytes()
        while data:
            (n,) = struct.unpack("<Q", data[:8])
            event = event_pb2.Event.FromString(data[12 : 12 + n])
            steps += [event.step for v in event.summary.value if v.tag == "x"]
            data = data[16 + n :]
    assert sorted(steps) == [0, 1]


@pytest.mark.slow
def test_validation_panels_come_from_the_games_of_val_options(tmp_path):
    # verl-agent validates ALFWorld on valid_seen / valid_unseen, not on training games: val.options and
    # val.holdout_options build those panels' games (here FaultyEnv's 7-task "valid" split) on their own pools
    import configs.textcraft_tiny
    from bipace_jax import build
    from bipace_jax import config as config_lib
    from bipace_jax.tiny import build_game_tokenizer
    from bipace_jax.trainer import Trainer
    from environments.testing import FaultyEnv

    c = configs.textcraft_tiny.get_config()
    c.model.checkpoint = ""
    c.model.hidden_size, c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 32, 1, 2, 1
    c.model.intermediate_size = 64
    c.env.max_steps, c.env.num_workers = 2, 1
    c.tasks.train, c.tasks.holdout = "all", ""
    c.rollout.num_groups, c.rollout.group_size = 2, 2
    c.sampler.max_new_tokens, c.sampler.batch_buckets = 8, (4, 8)
    c.ppo.micro_batch_rows, c.ppo.mini_batch_rows, c.ppo.old_logprobs = 8, 0, "recompute"
    c.val.num_tasks, c.val.num_holdout_tasks, c.val.seeds_per_goal = 3, 2, 1
    c.val.options, c.val.holdout_options = '{"split": "valid"}', '{"split": "valid", "max_steps": 1}'
    c.log.progress, c.rollout.show_inventory, c.rollout.template = False, False, ""
    tok = build_game_tokenizer(c, str(tmp_path / "tok"), num_tasks=4)
    tr = Trainer(c, str(tmp_path / "run"), tokenizer=tok, env_factory=FaultyEnv)
    try:
        assert [t for t, _ in tr.val_panel] == [0, 3, 6] and [t for t, _ in tr.holdout_panel] == [0, 6]
        assert len(tr.train_ids) == 100  # training goals from the game without options
        pools = tr.val_pools
        assert pools["val"] is not tr.pool and pools["val/holdout"] not in (tr.pool, pools["val"])
        assert pools["val"].env_options == {"max_steps": 2, "split": "valid"}
        assert pools["val/holdout"].env_options == {"max_steps": 1, "split": "valid"}
        v = tr.validate()
        assert v["val/tasks"] == 3 and v["val/holdout/tasks"] == 2 and v["val/tasks/depth_valid"] == 3
        assert v["val/holdout/episode_length"] == 1.0  # its own step cap: played on its own game
    finally:
        tr.close()
    c.val.options = '{"split": "test"}'
    with pytest.raises(config_lib.ConfigError, match=r"config.val.options: the game .* refused .*split must be"):
        Trainer(c, str(tmp_path / "run2"), tokenizer=tok, env_factory=FaultyEnv)
    c.val.options = "[1]"
    with pytest.raises(config_lib.ConfigError, match=r"config.val.options must be '' or a JSON object"):
        build.build_spec(c)


def test_checkpoint_meta_round_trips_and_reads_older_dicts(tmp_path):
    params, opt = _tree()
    meta = CheckpointMeta(iteration=3, task_cursor=24, epsilon=0.004, controller={"epsilon": 0.004}, seed=2)
    ck = Checkpointer(str(tmp_path))
    ck.save(3, params, opt, jax.random.PRNGKey(3), meta)
    *_, raw = ck.restore(3, params, opt)
    assert raw["step"] == 3 and len(raw["rng"]) == 2  # the checkpointer's own keys beside the meta's
    assert CheckpointMeta.from_dict(raw) == meta
    # a warm-start checkpoint of an older layout ({"round", "updates"}) restores with defaults
    old = CheckpointMeta.from_dict({"iteration": 1, "updates": 700, "round": 1, "step": 1})
    assert (old.iteration, old.updates, old.task_cursor, old.epsilon, old.controller) == (1, 700, 0, None, None)


def test_metric_keys_name_the_before_training_copy_once():
    assert keys.before("val/success_rate") == "val_before/success_rate"
    assert keys.before("val/holdout/success_rate/depth_2") == "val_before/holdout/success_rate/depth_2"
    assert keys.before(keys.VALIDATION_SECONDS) == "val_before/validation_s"
    assert keys.after("val_before/holdout/tasks") == "val/holdout/tasks"
    assert keys.stage_seconds("rollout") == "time/rollout_s"
    with pytest.raises(ValueError, match="val_before/"):
        keys.after("val/success_rate")
    with pytest.raises(ValueError, match="<section>/<name>"):
        keys.before("iteration")


def test_stage_timer_adds_up_each_stage(monkeypatch):
    clock = iter([0.0, 1.5, 2.0, 2.25, 10.0, 11.0])  # (enter, exit) pairs
    monkeypatch.setattr("bipace_jax.stats.time.perf_counter", lambda: next(clock))
    t = StageTimer()
    with t.stage("rollout"):
        pass
    with t.stage("update"):
        pass
    with t.stage("rollout"):
        pass
    assert t.seconds == {"rollout": 2.5, "update": 0.25} and t.total() == 2.75


def test_panel_metrics_leave_faulted_tasks_out_of_the_means():
    won = np.array([1.0, 0.0, np.nan, 1.0])
    length = np.array([3.0, 5.0, np.nan, 4.0])
    errors = np.array([0.0, 0.0, 2.0, 1.0])
    rec = panel_metrics("val", won, length, errors, np.full(4, np.nan))
    assert rec == {
        "val/success_rate": 2 / 3,
        "val/episode_length": 4.0,
        "val/tasks": 4,
        "val/env_errors": 3,
    }
    rec = panel_metrics(
        "val/holdout", np.full(2, np.nan), np.full(2, np.nan), np.array([1.0, 1.0]), np.array([0.5, np.nan])
    )
    assert rec["val/holdout/score"] == 0.5 and np.isnan(rec["val/holdout/success_rate"])


def test_the_trainer_reads_no_raw_config_field():
    # Trainer(spec) reads the decoded RunSpec; the source config only travels whole (process_layout,
    # the game tokenizer's corpus, config.json), never field by field
    import ast

    path = os.path.join(os.path.dirname(__file__), "..", "bipace_jax", "trainer.py")
    tree = ast.parse(open(path).read())
    raw = [
        f"line {n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "config"
        and not ast.unparse(n.value).endswith("actor.config")  # the model's own Qwen2Config
        and n.attr != "to_json_best_effort"
    ]
    assert not raw, raw
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "c" not in names  # the old loop's `c = self.config`
    assert "spec" in names  # the parser does see the trainer's code


def test_async_saves_commit_in_order_and_keep_the_buffers_they_were_given(tmp_path):
    # async: save returns after the copy to host memory, so the device buffers given to it may be freed
    # at once (as the next update's donation frees them) and the committed step still holds their values
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    opt = optax.adam(1e-3).init(params)
    ck = Checkpointer(str(tmp_path), keep=2, async_save=True)
    for step in (1, 2, 3):
        saved = jax.tree.map(lambda x, s=step: x + s, params)
        ck.save(step, saved, opt, jax.random.PRNGKey(step), CheckpointMeta(iteration=step))
        saved["w"].delete()  # what a donating update does to the buffer
    assert ck.latest_step() == 3 and ck.all_steps() == [2, 3]  # both wait for the last write
    ck.close()
    ck = Checkpointer(str(tmp_path), keep=2)
    step, (p, _, _, meta) = ck.restore_latest(params, opt)
    ck.close()
    assert step == 3 and meta["iteration"] == 3
    np.testing.assert_array_equal(p["w"], params["w"] + 3)


@pytest.mark.parametrize("change", ["shape", "structure"])
def test_an_intact_checkpoint_of_another_shape_is_refused_in_one_line_and_left_in_place(tmp_path, change):
    # the case 3: steps saved with float32[4], restored with float32[8] (a changed hidden size
    # and no config.json to say so) were both moved to torn/ and the run restarted at iteration 0
    from bipace_jax.checkpointing import CheckpointMismatchError

    params = {"w": jnp.zeros(4), "b": jnp.ones(2)}
    opt = optax.sgd(0.1).init(params)
    ck = Checkpointer(str(tmp_path), keep=5)
    for step in (1, 2):
        ck.save(step, params, opt, jax.random.PRNGKey(step), {"iteration": step})
    if change == "shape":
        wanted, match = {"w": jnp.zeros(8), "b": jnp.ones(2)}, r"params\.w: stored float32\[4\], requested float32\[8\]"
    else:
        wanted, match = {"w": jnp.zeros(4), "b": jnp.ones(2), "extra": jnp.ones(3)}, r"params\.extra: not stored"
    with pytest.raises(CheckpointMismatchError, match=match) as info:
        Checkpointer(str(tmp_path)).restore_latest(wanted, optax.sgd(0.1).init(wanted))
    assert "\n" not in str(info.value) and "step 2" in str(info.value)
    assert ck.all_steps() == [1, 2] and not os.path.exists(os.path.join(ck.directory, "torn"))
    assert ck.restore_latest(params, opt)[0] == 2  # the run that saved them still resumes


def test_a_pool_of_fewer_games_than_env_num_workers_starts_one_worker_per_game():
    # the learner process of async_rl.sampler_processes=1 plays no training game: with validation off its
    # pool holds 1 game, and textcraft_tiny asks env.num_workers=2 (it raised "num_workers must be ... in
    # [1, num_envs=1]" before anything else)
    import configs.textcraft_tiny
    from bipace_jax import build, validation

    c = configs.textcraft_tiny.get_config()
    c.val.at_start, c.val.every = False, 0
    spec = build.build_spec(c)
    assert spec.env.num_workers == 2
    panels = validation.select(spec, spec.env.name)
    pool, pools = validation.start_pools(spec, spec.env.name, panels, 1, 0)
    try:
        assert (pool.num_envs, pool.num_workers) == (1, 1) and all(p is pool for p in pools.values())
    finally:
        pool.close()
    pool = validation.make_pool(spec, spec.env.name, {"max_steps": 2}, 3)  # enough games: the config's 2
    try:
        assert (pool.num_envs, pool.num_workers) == (3, 2)
    finally:
        pool.close()
