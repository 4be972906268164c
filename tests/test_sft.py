"""Warm start (bipace_jax.sft): data format, the loss and its exact token mean, DAgger labels, summaries."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import environments
from bipace_jax import demos
from bipace_jax.learner import Learner
from bipace_jax.models import Qwen2Actor
from bipace_jax.rollout import Episode, RolloutConfig, collect
from bipace_jax.sampling import SampleOutput, SamplerConfig
from bipace_jax.sft import (
    Example,
    ResponseNLL,
    dagger_file,
    dagger_records,
    encode_response,
    expert_examples,
    first_games,
    make_batch,
    panel_record,
    play_order,
    read_dagger_examples,
    record_example,
    token_nll,
    train_step,
    validate_config,
)
from bipace_jax.sharding import make_mesh
from bipace_jax.tiny import warm_start_tokenizer
from configs.textcraft_tasks import TEMPLATE
from environments.pool import EnvPool
from environments.prompts import build_prompt
from tests.qwen_fixtures import one_layer_config

TASKS = [300, 301, 150]  # three depth-2 goals
RCFG = RolloutConfig(
    game="textcraft",
    group_size=1,
    max_steps=15,
    history_length=0,
    max_prompt_length=448,
    show_inventory=True,
    template=TEMPLATE,
)


@pytest.fixture(scope="module")
def tok():
    return warm_start_tokenizer("textcraft", TEMPLATE, vocab_size=400, seeds=1, task_ids=TASKS)


@pytest.fixture(scope="module")
def pool():
    with EnvPool("textcraft", 2, env_options={"max_steps": 15}, num_workers=1) as p:
        yield p


def chat(tok, user):
    return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


def test_expert_examples_are_the_rl_prompt_and_the_oracle_action_in_tags(tok):
    env = environments.make("textcraft", max_steps=15)
    examples, stats = expert_examples(env, RCFG, tok, [(300, 0)])
    assert stats["oracle_win_rate"] == 1.0 and stats["oracle_mean_length"] == len(examples)
    assert [e.key for e in examples] == [f"300_0_{t}" for t in range(len(examples))]  # as the dataset's record keys
    env = environments.make("textcraft", max_steps=15)
    obs, history = env.reset(300, 0), []
    for step, ex in enumerate(examples):  # replay: each example is (chat(build_prompt(state)), oracle action)
        action = env.oracle_action()
        user = build_prompt("textcraft", obs, history, step, history_length=0, show_inventory=True, template=TEMPLATE)
        assert tok.decode(ex.prompt_ids) == chat(tok, user)
        assert tok.decode(ex.response_ids) == f"<action>{action}</action><|im_end|>"
        assert ex.depth == 2 and ex.source == "expert"
        history.append((obs.text, action))
        obs, _, done, _ = env.step(action)
    assert done and obs.won


def test_make_batch_places_targets_after_the_prompt():
    ex = [Example([5, 6, 7], [8, 9]), Example([5], [8, 9, 10])]
    b = make_batch(ex, length=6, pad_id=0, response_length=4)
    np.testing.assert_array_equal(b.input_ids, [[5, 6, 7, 8, 9, 0], [5, 8, 9, 10, 0, 0]])
    np.testing.assert_array_equal(b.attention_mask, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    # column t predicts token t+1: the last prompt column predicts the first response token
    np.testing.assert_array_equal(b.positions, [[2, 3, 0, 0], [0, 1, 2, 0]])
    np.testing.assert_array_equal(b.targets, [[8, 9, 0, 0], [8, 9, 10, 0]])
    np.testing.assert_array_equal(b.target_mask, [[1, 1, 0, 0], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="response_length"):
        make_batch(ex, length=6, pad_id=0, response_length=2)
    with pytest.raises(ValueError, match="length bucket"):
        make_batch(ex, length=4, pad_id=0, response_length=4)


def test_token_nll_by_hand():
    # Row 0: p(target) = 3/4 and 1/2 (argmax right, then a tie broken to index 0: wrong); row 1 masked out.
    logits = np.array([[[0.0, math.log(3.0)], [0.0, 0.0]], [[5.0, -5.0], [5.0, -5.0]]], np.float32)
    targets = np.array([[1, 1], [1, 1]], np.int32)
    mask = np.array([[1, 1], [0, 0]], np.float32)
    loss, acc = token_nll(logits, targets, mask)
    np.testing.assert_allclose(float(loss), (math.log(4 / 3) + math.log(2)) / 2, rtol=1e-6)
    assert float(acc) == 0.5
    loss, acc = token_nll(logits, targets, mask, denom=4.0)  # a batch-wide denominator
    np.testing.assert_allclose(float(loss), (math.log(4 / 3) + math.log(2)) / 4, rtol=1e-6)


def tiny_learner(vocab, lr=0.0):
    actor = Qwen2Actor(one_layer_config(vocab, heads=2, kv_heads=1), rngs=nnx.Rngs(0))
    return Learner(actor, make_mesh(1, 1, 1, devices=jax.devices()[:1]), optax.sgd(lr))


@pytest.mark.slow
def test_micro_batches_give_the_exact_token_mean_of_the_batch():
    """Rows with 1 to 3 response tokens: the step's loss is the mean NLL over the batch's 9 real response
    tokens, computed here from the full logits, whatever the micro-batch split."""
    rng = np.random.default_rng(0)
    ex = [
        Example(list(rng.integers(3, 50, p)), list(rng.integers(3, 50, r))) for p, r in ((4, 1), (2, 3), (5, 2), (3, 3))
    ]
    batch = make_batch(ex, length=8, pad_id=0, response_length=3)
    learner = tiny_learner(64)
    logits = np.asarray(learner.actor(jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)).logits)
    nll, n, right = 0.0, 0, 0
    for r, e in enumerate(ex):
        for k, t in enumerate(e.response_ids):
            row = logits[r, len(e.prompt_ids) - 1 + k].astype(np.float64)
            nll += np.log(np.exp(row - row.max()).sum()) + row.max() - row[t]
            right += int(row.argmax() == t)
            n += 1
    assert n == 9
    whole = train_step(learner, batch, 0)
    split = train_step(learner, batch, 1)  # four one-row micro-batches; lr 0 keeps the parameters
    for got in (whole, split):
        np.testing.assert_allclose(got["loss"], nll / n, rtol=1e-5)
        np.testing.assert_allclose(got["token_accuracy"], right / n, rtol=1e-6)
    np.testing.assert_allclose(whole["grad_norm"], split["grad_norm"], rtol=1e-4)
    assert ResponseNLL() == ResponseNLL() and hash(ResponseNLL()) == hash(ResponseNLL())


class ScriptedSampler:
    """Answers each turn with ``script(turn, live env count)`` texts, like a Sampler."""

    def __init__(self, tok, script):
        self.config = SamplerConfig(max_new_tokens=24, length_buckets=(448,))
        self.tok, self.tokenizer, self.script, self.turn = tok, tok, script, 0
        self.eos_token_ids, self.pad_id = (tok.eos_token_id,), tok.pad_token_id

    def length_bucket(self, t):
        return 448

    def generate(self, actor, prompts, key, *, temperature=None, row_keys=None, groups=None):
        texts = self.script(self.turn, len(prompts))
        self.turn += 1
        m = self.config.max_new_tokens
        tokens = np.full((len(prompts), m), self.pad_id, np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for r, text in enumerate(texts):
            ids = self.tok.encode(text) + [self.tok.eos_token_id]
            tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        return SampleOutput(
            tokens, lengths, np.zeros((len(prompts), m), np.float32), np.eye(len(prompts), 4, dtype=np.float32)
        )


def test_dagger_labels_every_visited_state_with_the_oracle_action_from_that_state(tok, pool):
    """The policy first wastes a step on a wrong `get`, then follows the oracle: every row's label is
    the oracle's action from the state that row's prompt showed (the recovery data DAgger adds)."""

    def script(turn, n):
        return ["<action>get 1 dirt</action>" if turn == 0 else f"<action>{pool.oracle_actions([0])[0]}</action>"]

    res = collect(
        None, ScriptedSampler(tok, script), pool, [(300, 7)], RCFG, jax.random.key(0), labeler=pool.oracle_actions
    )
    ep = res.episodes[0]
    assert ep.won and ep.invalid_count == 0 and ep.length == res.num_rows == len([r.label for r in res.rows])
    examples = [record_example(r, RCFG, tok) for r in dagger_records(res, 2, "textcraft")]
    assert len(examples) == res.num_rows and all(e.source == "dagger" and e.depth == 2 for e in examples)
    assert [e.key for e in examples] == [f"dagger2_{r}" for r in range(res.num_rows)]
    # replay the actions sent: every label is the oracle's action from that state, every prompt the RL one
    env = environments.make("textcraft", max_steps=15)
    obs, history = env.reset(300, 7), []
    for step, (ex, action) in enumerate(zip(examples, [r.action for r in res.rows])):
        want = env.oracle_action()
        assert res.rows[step].label == want
        assert tok.decode(ex.response_ids) == f"<action>{want}</action><|im_end|>"
        user = build_prompt("textcraft", obs, history, step, history_length=0, show_inventory=True, template=TEMPLATE)
        assert tok.decode(ex.prompt_ids) == chat(tok, user)
        history.append((obs.text, action))
        obs, _, _, _ = env.step(action)
    assert res.rows[0].action == "get 1 dirt" and res.rows[0].label != "get 1 dirt"


@pytest.fixture(scope="module")
def dagger_run(tok, pool):
    """A labelled collect with history: env 0 (task 300) wastes its first step on a wrong `get`, then follows
    the oracle and wins; env 1 (task 301) never answers in tags (the fallback every turn) and loses. History
    2 and a 320-token prompt cap, so late prompts of env 1 drop history entries to fit."""
    rcfg = dataclasses.replace(RCFG, history_length=2, max_prompt_length=320)

    def script(turn, n):  # live envs ascending: env 0 first while it plays
        first = "<action>get 1 dirt</action>" if turn == 0 else f"<action>{pool.oracle_actions([0])[0]}</action>"
        return [first, "no tags"] if n == 2 else ["no tags"]

    res = collect(
        None,
        ScriptedSampler(tok, script),
        pool,
        [(300, 7), (301, 2)],
        rcfg,
        jax.random.key(0),
        labeler=pool.oracle_actions,
    )
    assert [(e.won, e.length) for e in res.episodes] == [(True, res.episodes[0].length), (False, 15)]
    assert res.stats.values()["truncations"] > 0 and res.num_rows == res.episodes[0].length + 15
    return rcfg, res


def test_dagger_records_encode_to_exactly_the_token_ids_collect_fed_the_sampler(tok, dagger_run, tmp_path):
    """The examples the old path saved (each row's prompt ids as collect fed them to the sampler, its oracle
    label as the response, key dagger<round>_<row>) are record_example of the records written and read back:
    same order, keys, prompt and response ids, with history shown and history dropped to fit."""
    rcfg, res = dagger_run
    want = [
        Example(
            res.prompt_ids[r][res.prompt_mask[r] == 1].tolist(), encode_response(tok, lab), 2, "dagger", f"dagger3_{r}"
        )
        for r, lab in enumerate([r.label for r in res.rows])
    ]
    demos.write_records(dagger_file(tmp_path, 3), dagger_records(res, 3, "textcraft"))
    got = read_dagger_examples(tmp_path, 3, rcfg, tok)
    assert len(got) == res.num_rows == 22 and got == want
    assert max(len(demos.history_of(r)) for r in demos.read_records(dagger_file(tmp_path, 3))) == 14


def test_dagger_records_hold_the_state_the_history_and_the_oracle_label(dagger_run, tmp_path):
    """Every field of a DAgger record, read back from its file, against a replay of the actions sent."""
    rcfg, res = dagger_run
    records = dagger_records(res, 3, "textcraft")
    demos.write_records(tmp_path / "r.jsonl", records)
    back = demos.read_records(tmp_path / "r.jsonl", demos.FIELDS + demos.DAGGER_FIELDS)
    assert back == records and list(back[0]) == [*demos.FIELDS, *demos.DAGGER_FIELDS]
    oracle = demos.oracle_version("textcraft")
    assert oracle.startswith("textcraft planner (environments.textcraft) textcraft==")
    row = 0
    for (task, seed), won in (((300, 7), True), ((301, 2), False)):
        env = environments.make("textcraft", max_steps=15)
        obs, history = env.reset(task, seed), []
        for turn in range(res.episodes[task - 300].length):
            r, label = back[row], env.oracle_action()
            assert (r["game"], r["task_id"], r["seed"], r["turn"], r["depth"]) == ("textcraft", task, seed, turn, 2)
            assert demos.observation_of(r) == obs and demos.history_of(r) == history
            assert r["action"] == label == res.rows[row].label and r["response"] == f"<action>{label}</action>"
            assert (r["won"], r["oracle"], r["round"], r["row"]) == (won, oracle, 3, row)
            history.append((obs.text, res.rows[row].action))
            obs = env.step(res.rows[row].action)[0]
            row += 1
    assert row == len(back) and history[0][1] == "inventory"  # env 1 sent the fallback


def test_a_finished_round_without_its_records_is_refused_naming_the_old_format(tok, tmp_path):
    with pytest.raises(ValueError, match=r"DAgger round 0 is finished but .*dagger_0\.jsonl does not exist \(the run"):
        read_dagger_examples(tmp_path, 0, RCFG, tok)
    (tmp_path / "dagger_0.json").write_text("[]")
    with pytest.raises(ValueError, match=r"holds dagger_0\.json, the token-id format of an older version"):
        read_dagger_examples(tmp_path, 0, RCFG, tok)
    (tmp_path / "dagger_0.jsonl").write_text('{"game": "textcraft"}\n')
    with pytest.raises(ValueError, match=r"line 1: a record needs the fields .* missing \['task_id'"):
        read_dagger_examples(tmp_path, 0, RCFG, tok)


def test_unparsable_responses_count_as_invalid_and_send_the_fallback(tok, pool):
    rcfg = dataclasses.replace(RCFG, max_steps=3)
    res = collect(
        None, ScriptedSampler(tok, lambda turn, n: ["no tags"] * n), pool, [(300, 1), (301, 2)], rcfg, jax.random.key(0)
    )
    assert [e.won for e in res.episodes] == [False, False]
    assert [e.invalid_count for e in res.episodes] == [3, 3] and {r.action for r in res.rows} == {"inventory"}
    stats = res.stats.values()
    assert stats["success_rate"] == 0.0 and stats["invalid_rate"] == 1.0  # what a DAgger round logs
    assert [e.length for e in res.episodes] == [3, 3]


def test_panel_record_is_rls_record_of_the_seen_then_held_out_games():
    def ep(task, won, length, fault=None):
        return Episode(task, 0, 0, 0, won=won, length=length, env_error=fault)

    depth = {1: 2, 2: 2, 3: 3, 4: 2, 5: 3}
    panels = {"val": [(1, 10), (2, 11), (3, 12)], "val/holdout": [(4, 13), (5, 14)]}
    eps = [ep(1, True, 4), ep(2, False, 15), ep(3, True, 6), ep(4, True, 5), ep(5, False, 9, "timeout")]
    assert play_order(panels) == [(1, 10), (2, 11), (3, 12), (4, 13), (5, 14)] and play_order(panels, 4)[-1] == (4, 13)
    rec = panel_record(eps, panels, lambda t: {"depth": depth[t]}, ("depth",))
    # seen: 2 of 3 won, lengths 4, 15, 6; depth 2: 1 of 2, depth 3: 1 of 1
    assert rec["val/success_rate"] == pytest.approx(2 / 3) and rec["val/episode_length"] == pytest.approx(25 / 3)
    assert (rec["val/success_rate/depth_2"], rec["val/success_rate/depth_3"]) == (0.5, 1.0)
    assert (rec["val/tasks"], rec["val/tasks/depth_2"], rec["val/env_errors"]) == (3, 2, 0)
    # held-out: the faulted game is left out of the rates and counted
    assert rec["val/holdout/success_rate"] == 1.0 and rec["val/holdout/env_errors"] == 1
    assert rec["val/holdout/tasks/depth_2"] == 1 and "val/holdout/tasks/depth_3" not in rec
    assert first_games(panels, 4) == {"val": panels["val"], "val/holdout": [(4, 13)]}


def test_bad_config_fails_with_one_line_naming_the_field():
    from configs.sft_textcraft_tiny import get_config

    c = get_config()
    c.train.batch_size = 0
    with pytest.raises(ValueError, match=r"config\.train\.batch_size must be >= 1"):
        validate_config(c)
    c = get_config()
    c.train.micro_batch_rows = 5
    with pytest.raises(ValueError, match=r"config\.train\.micro_batch_rows must be >= 0 and divide"):
        validate_config(c)
    c = get_config()
    c.train.checkpoint_every = 30  # log_every 25: a resume would start a metrics window mid-way
    with pytest.raises(
        ValueError, match=r"config\.train\.checkpoint_every must be 0 or a multiple of train\.log_every=25, got 30"
    ):
        validate_config(c)


def test_rl_and_warm_start_prompts_are_the_same_ids_for_the_same_game_state():
    # the shipped warm start learned from its own prompts; RL must show the very same ids (an empty
    # system turn, 9 extra tokens, once changed 10 of 54 panel outcomes)
    import configs.sft_textcraft_tiny
    import configs.textcraft_tiny
    from bipace_jax import build, sft
    from bipace_jax.config import resolve_path
    from bipace_jax.models import load_tokenizer
    from bipace_jax.rollout import encode_prompt

    rl_cfg, ws_cfg = configs.textcraft_tiny.get_config(), configs.sft_textcraft_tiny.get_config()
    tok = load_tokenizer(resolve_path(rl_cfg.model.checkpoint))
    rl = build.rollout_config(rl_cfg, group_size=1)
    ws = sft.rollout_config(ws_cfg)
    assert rl.system_prompt is None and ws.system_prompt is None
    env = environments.make("textcraft", max_steps=15)
    obs = env.reset(272, 5)
    history, start = [], tok.encode("<|im_start|>user\n", add_special_tokens=False)
    for step in range(3):
        a = encode_prompt(tok, rl, obs, history, step, "rl")
        b = encode_prompt(tok, ws, obs, history, step, "warm start")
        assert a == b and a[0][: len(start)] == start  # no system turn at all
        action = env.oracle_action()
        history.append((obs.text, action))
        obs = env.step(action)[0]


def test_warm_start_config_speaks_the_rl_dialect():
    # the sections shared with RL carry RL's field names (configs/base.py), with the same meaning
    import configs.base
    import configs.sft_textcraft_tiny
    from bipace_jax.sft import build_warm_start

    rl, ws = configs.base.get_config(), configs.sft_textcraft_tiny.get_config()
    for section in ("model", "env", "tasks", "rollout", "sampler", "optim"):
        assert set(ws[section]) <= set(rl[section]), (section, set(ws[section]) - set(rl[section]))
    assert set(ws.val) - set(rl.val) == {"rl_every", "every_round"}
    spec = build_warm_start(ws)
    assert (spec.env.name, spec.tasks.train, spec.val.num_tasks) == ("textcraft", ws.tasks.train, ws.val.num_tasks)
    assert spec.rollout.max_prompt_length == ws.sampler.length_buckets[-1] == spec.sampler.length_buckets[-1]
    assert spec.total_updates == 600 + 4 * 100
    greedy, dagger = spec.sampler_at(0.0), spec.sampler_at(0.4)
    assert (greedy.greedy, greedy.temperature, dagger.greedy, dagger.temperature) == (True, 1.0, False, 0.4)
    # RL's ModelConfig and tiny preset (one mapping of the sizes); the exported config.json keeps 2048 positions
    from bipace_jax import build, sft

    arch = build.actor_architecture(spec.model, 1100, 3, max_position_embeddings=sft.MAX_POSITIONS)
    shape = (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads)
    assert shape == (128, 3, 4, 2) and (arch.intermediate_size, arch.vocab_size, arch.eos_token_ids) == (
        384,
        1100,
        (3,),
    )
    assert arch.max_position_embeddings == 2048 and spec.model.preset == "tiny" and spec.model.vocab_size == 1024
    assert spec.optim.schedule == "warmup_cosine" and spec.optim.warmup_steps == 50
    ws.sampler.length_buckets = (448, 160)
    with pytest.raises(ValueError, match=r"^config\.sampler\.length_buckets must be a non-empty strictly ascending"):
        build_warm_start(ws)
    ws = configs.sft_textcraft_tiny.get_config()
    ws.env.name = "minecraft"
    with pytest.raises(ValueError, match=r"^config\.env\.name must be one of"):
        build_warm_start(ws)
