"""The embedded default's TextCraft task set, prompt options and validation panel.

Shared by the warm start (`bipace_jax/sft/`, `configs/sft_textcraft_tiny.py`) and the RL default
(`configs/textcraft_tiny.py`), so both play exactly the same prompts.

Task set: the TextCraft goals selected by `TRAIN` (a task selector, `bipace_jax.tasks.select_tasks`: "key=v1,v2" filters on `env.task_info`). Held-out goals: every
`HOLDOUT_EVERY`-th goal of that set in task-id order (ids listed by `heldout_ids`), never trained on,
validated separately. Training game seeds are `< VAL_SEED_BASE`; the validation panel uses seeds
from `VAL_SEED_BASE` up (new distractor recipes and order).
"""

from __future__ import annotations

import environments
from bipace_jax.tasks import select_tasks, split_holdout
from bipace_jax.tasks import validation_panel as panels

GAME = "textcraft"
# The default task set: the first 80 (by task id, i.e. alphabetical) depth-2 goals whose oracle
# plan from an empty inventory crafts every recipe once (no repeated crafts: each count in the plan
# is one recipe's amount). `single_craft_goals` recomputes it; a test pins the list to it.
TRAIN_IDS = (
    129,
    132,
    133,
    135,
    138,
    140,
    144,
    146,
    147,
    148,
    150,
    153,
    154,
    155,
    156,
    157,
    159,
    161,
    162,
    163,
    164,
    166,
    167,
    168,
    172,
    173,
    174,
    175,
    176,
    178,
    179,
    180,
    182,
    186,
    187,
    188,
    190,
    191,
    192,
    194,
    199,
    201,
    203,
    204,
    205,
    207,
    210,
    212,
    213,
    214,
    215,
    216,
    220,
    223,
    224,
    225,
    226,
    227,
    228,
    229,
    239,
    241,
    242,
    243,
    244,
    245,
    257,
    263,
    265,
    266,
    267,
    269,
    278,
    279,
    280,
    281,
    282,
    283,
    284,
    285,
)
TRAIN = ",".join(map(str, TRAIN_IDS))  # task selector (trainer syntax: an id list)
HOLDOUT_EVERY = 8  # every 8th goal of the set (by task id) is held out: 10 goals
HOLDOUT_IDS = TRAIN_IDS[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY]
HOLDOUT = ",".join(map(str, HOLDOUT_IDS))  # the trainer's `tasks.holdout` (removed from tasks.train)
MAX_STEPS = 15  # step cap per episode
HISTORY_LENGTH = 0  # (observation, action) pairs shown: none, the inventory carries the state
SHOW_INVENTORY = True  # the prompt shows the current inventory (a template option)
SYSTEM_PROMPT = "default"  # the chat template's own: none for the project's tokenizer (RL and warm start alike)
FALLBACK_ACTION = "inventory"  # sent to the game for an unparsable response
# A compact prompt (`environments.prompts.PromptTemplate` field overrides, RolloutConfig.template):
# the crafting commands and goal, the step, the last feedback and the inventory; no boilerplate
# (the default template's rules and think instruction are ~120 of its ~340 tokens). The tiny
# actor answers with `<action>...</action>` and no think.
TEMPLATE = {
    "first": "{task}\nStep {current_step}: {observation}{inventory}\nAnswer <action>command</action>.",
    "later": ("{task}\n{history}\nStep {current_step}: {observation}{inventory}\nAnswer <action>command</action>."),
    "history_entry": "Step {index}: {observation} > {action}",
    "task_echo": "start",
}
# The RL task set: every 4th goal of the warm start's 70 training goals (18 goals). The warm start
# learns from all 70; RL trains on these 18, so that the README's few iterations of 8 task groups
# visit each goal several times (RL_EVERY = 1 gives all 70, each visited about once per 9 iterations).
RL_EVERY = 4
RL_TRAIN_IDS = tuple(t for t in TRAIN_IDS if t not in HOLDOUT_IDS)[::RL_EVERY]
RL_TRAIN = ",".join(map(str, RL_TRAIN_IDS))  # the trainer's `tasks.train`
VAL_SEED_BASE = 1_000_000  # validation game seeds start here; training seeds stay below
VAL_NUM_SEEN = 18  # panel: goals of the RL task set (all 18)...
VAL_NUM_HELDOUT = 16  # ...and held-out goals (all 10)...
VAL_SEEDS_PER_GOAL = 3  # ...each played with 3 unseen seeds: 54 + 30 games
VAL_TEMPERATURE = 0.4


def split(env, selector: str = TRAIN, holdout_every: int = HOLDOUT_EVERY) -> tuple[list[int], list[int]]:
    """(training goals, held-out goals) of the task set: every `holdout_every`-th id is held out."""
    return split_holdout(select_tasks(selector, env.num_tasks, env.task_info), [], holdout_every)


def validation_panel(
    train_ids,
    heldout_ids,
    num_seen: int = VAL_NUM_SEEN,
    num_heldout: int = VAL_NUM_HELDOUT,
    seed: int = 0,
    seeds_per_goal: int = VAL_SEEDS_PER_GOAL,
    rl_every: int = RL_EVERY,
) -> list[tuple[int, int]]:
    """The fixed, seeded validation panel: (task_id, game_seed) pairs, seen games first.

    Exactly the RL trainer's panel (`bipace_jax.tasks.validation_panel`, mode "spread") for the
    RL task set `train_ids[::rl_every]`: `num_seen` of those goals and `num_heldout` held-out
    goals (all when fewer), each with `seeds_per_goal` game seeds from `VAL_SEED_BASE + seed * 10_000`.
    """
    seen, held = panels(
        list(train_ids)[::rl_every],
        list(heldout_ids),
        num_seen,
        num_heldout,
        VAL_SEED_BASE + seed * 10_000,
        "spread",
        seeds_per_goal,
    )
    return seen + held


def single_craft_goals(env, depth: int = 2, limit: int | None = 80, seeds=(0, 1)) -> list[int]:
    """Goals of `depth` whose oracle plan (from an empty inventory, for each of `seeds`) has no
    repeated craft command; the first `limit` by task id (all when None)."""
    out = []
    for t in range(env.num_tasks):
        if env.task_info(t).get("depth") != depth:
            continue
        ok = True
        for seed in seeds:
            env.reset(t, seed)
            crafts = [a for a in env.oracle_plan() if a.startswith("craft")]
            ok &= len(set(crafts)) == len(crafts)
        if ok:
            out.append(t)
    return out if limit is None else out[:limit]


def heldout_ids() -> list[int]:
    """The held-out goal ids of the default task set (builds a TextCraft env to read depths)."""
    return split(environments.make(GAME, max_steps=MAX_STEPS))[1]
