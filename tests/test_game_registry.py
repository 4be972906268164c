"""Adding a game is one module plus its registration: a toy guessing game registered here plays in pool
workers, takes its prompt, fallback action and validation categories from its GameSpec, and trains one
RL iteration with the tiny actor."""

from __future__ import annotations

import pytest

import environments
from environments import registry
from environments.base import Observation, TextEnv
from environments.pool import EnvPool
from environments.prompts import THINK_ACT, PromptTemplate, build_prompt, parse_action


class GuessEnv(TextEnv):
    """Guess the number ``task_id % 3 + 1`` (1..3); a wrong guess shows "higher" or "lower".

    Six tasks; ``task_info`` is ``{"size": "small"}`` for tasks 0-2, ``"big"`` for 3-5 (the category),
    and a ``best_score`` like WebShop's (task 5's 0.5: a goal no play can win, as far as the
    validation record knows); the reward is 1.0 on the right guess. The oracle guesses the number.
    """

    def __init__(self, max_steps: int = 2):
        super().__init__(max_steps)
        self.target = 0

    @property
    def num_tasks(self) -> int:
        return 6

    def task_info(self, task_id: int) -> dict:
        return {"size": "small" if task_id < 3 else "big", "best_score": 0.5 if task_id == 5 else 1.0}

    def _obs(self, text: str, won: bool = False) -> Observation:
        return Observation(text=text, anchor=text, task="guess the number from 1 to 3", won=won)

    def _reset(self, task_id: int, seed: int) -> Observation:
        self.target = task_id % 3 + 1
        return self._obs("make a guess")

    def _step(self, action: str):
        guess = action.removeprefix("guess ").strip()
        if guess == str(self.target):
            return self._obs("right", won=True), 1.0, True, {}
        hint = "higher" if guess in [str(k) for k in range(1, self.target)] else "lower"
        return self._obs(hint), 0.0, False, {}

    def oracle_action(self) -> str | None:
        return None if self._done else f"guess {self.target}"


# The registration: the game's whole contract with the rollout and the trainer.
SPEC = registry.register_game(
    registry.GameSpec(
        name="guess",
        factory=GuessEnv,
        template=PromptTemplate(
            first="Guess game: {task}. Step {current_step}: {observation}\n" + THINK_ACT,
            later="Guess game: {task}. So far:\n{history}\nStep {current_step}: {observation}\n" + THINK_ACT,
        ),
        fallback_action="guess 1",
        categories=("size",),
    )
)


def test_the_registered_toy_game_is_made_prompted_and_played_in_pool_workers():
    assert "guess" in environments.registered() and environments.game_spec("guess") is SPEC
    env = environments.make("guess", max_steps=2)
    assert env.reset(4, 0).text == "make a guess" and env.oracle_action() == "guess 2"
    assert env.step("guess 1")[:3] == (env._obs("higher"), 0.0, False)
    prompt = build_prompt("guess", env._obs("higher"), [("make a guess", "guess 1")], 1)
    assert prompt.startswith("Guess game: guess the number from 1 to 3. So far:\n[Observation 1: 'make a guess'")
    # the pool's workers build the game from the spec's factory (pickled by reference) and run its oracle
    with EnvPool("guess", 2, env_options={"max_steps": 2}, num_workers=1) as pool:
        assert [r.obs.text for r in pool.reset([0, 1], [2, 5], [0, 0])] == ["make a guess"] * 2
        assert pool.oracle_actions([0, 1]) == ["guess 3", "guess 3"]
        r0, r1 = pool.step([0, 1], ["guess 3", "guess 9"])
        assert (r0.reward, r0.done, r0.obs.won, r0.fault) == (1.0, True, True, None)
        assert (r1.reward, r1.done, r1.obs.text) == (0.0, False, "lower")
        assert [r.info for r in pool.task_info([0, 1])] == [
            {"size": "small", "best_score": 1.0},
            {"size": "big", "best_score": 0.5},
        ]
    from bipace_jax.rollout import RolloutConfig

    assert RolloutConfig(game="guess").fallback == "guess 1"


def test_a_game_spec_names_the_bad_field_and_a_name_registers_once():
    ok = dict(name="g2", factory=GuessEnv, template=SPEC.template, fallback_action="guess 1")
    for field, value, match in [
        ("name", "", "GameSpec.name must be a non-empty str"),
        ("factory", 3, "GameSpec.factory of 'g2' must be callable"),
        ("template", {"first": "x"}, "GameSpec.template of 'g2' must be a PromptTemplate, got dict"),
        ("fallback_action", " ", "GameSpec.fallback_action of 'g2' must be a non-empty str"),
        ("categories", "size", "GameSpec.categories of 'g2' must be a tuple of task_info keys, got 'size'"),
    ]:
        with pytest.raises(ValueError, match=match):
            registry.GameSpec(**{**ok, field: value})
    assert registry.GameSpec(**ok, categories=["size"]).categories == ("size",)
    with pytest.raises(ValueError, match="'guess' is already registered"):
        registry.register_game(registry.GameSpec(**{**ok, "name": "guess"}))
    registry.register_game(registry.GameSpec(**ok))
    registry.unregister("g2")
    with pytest.raises(ValueError, match="unknown environment 'g2'"):
        environments.make("g2")


@pytest.mark.e2e
def test_the_toy_game_trains_one_rl_iteration_and_validates_by_its_categories(tmp_path, monkeypatch):
    import jax
    import numpy as np

    import configs.textcraft_tiny
    from bipace_jax import metric_keys, validation
    from bipace_jax.tiny import build_game_tokenizer
    from bipace_jax.trainer import Trainer
    from tests.tiny_runs import use_tiny_actor

    c = configs.textcraft_tiny.get_config()
    c.env.name, c.env.max_steps, c.env.num_workers = "guess", 2, 1
    c.tasks.train, c.tasks.holdout = "all", ""
    use_tiny_actor(c)
    c.rollout.num_groups, c.rollout.group_size = 2, 2
    c.rollout.template, c.rollout.fallback_action = "", ""  # the game's own
    c.rollout.show_inventory, c.rollout.max_prompt_length = False, 256
    c.sampler.max_new_tokens, c.sampler.batch_buckets, c.sampler.length_buckets = 8, (4, 8), (256,)
    c.sampler.temperature = c.val.temperature  # one sampler program for training and validation
    c.ppo.micro_batch_rows, c.ppo.mini_batch_rows, c.ppo.old_logprobs = 8, 0, "recompute"
    c.estimator.calibration.enabled, c.estimator.controller.enabled = False, False
    c.val.every, c.val.at_start, c.val.num_tasks, c.val.num_holdout_tasks = 1, False, 6, 0
    c.val.seeds_per_goal = 1
    c.log.progress, c.log.plots = False, False
    tokenizer = build_game_tokenizer(c, str(tmp_path / "tok"), num_tasks=6)
    tr = Trainer(c, str(tmp_path / "run"), tokenizer=tokenizer)
    plays, play = [], tr._play
    tr._play = lambda *a, **k: plays.append(play(*a, **k)) or plays[-1]  # keeps every collect's result
    panels, validate = [], validation.validate

    def keep_panels(*a, **k):  # the trainer validates through validation.validate; keep its per-panel results
        rec, results = validate(*a, **k)
        panels.append(results)
        return rec, results

    monkeypatch.setattr(validation, "validate", keep_panels)
    before = jax.tree.map(np.asarray, tr.learner.params)
    try:
        rec = tr.train_iteration()
        val = tr.validate()
    finally:
        tr.close()
    res = plays[0]  # the training collect
    assert tr.iteration == 1 and rec["loss/updates"] == 1 and rec["train/rows"] == res.num_rows > 0
    after = jax.tree.map(np.asarray, tr.learner.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    # the prompt is the spec's template; an invalid response sends the spec's fallback action
    assert tokenizer.decode(res.prompt_ids[0][res.prompt_mask[0] == 1]).count("Guess game: guess the number") == 1
    for row in res.rows:
        command, valid = parse_action(row.text)
        assert row.action == (command if valid else "guess 1")
    assert all(ep.task_info["size"] in ("small", "big") for ep in res.episodes)
    # validation splits success by the spec's categories: 3 small and 3 big tasks
    assert len(plays) == 1 and len(panels) == 1 and val["val/env_errors"] == 0
    assert len(panels[0][metric_keys.VAL].episodes) == 6
    assert val["val/tasks"] == 6 and val["val/tasks/size_small"] == val["val/tasks/size_big"] == 3
    assert val["val/unwinnable_goals"] == 1  # task 5's best_score 0.5
    want = [val["val/success_rate/size_small"], val["val/success_rate/size_big"]]
    assert val["val/success_rate"] == pytest.approx(np.mean(want))
    assert not any("depth" in k or "task_type" in k for k in val)
