"""The embedded default's TextCraft task set, prompt options and validation panel (issue 7).

Shared by the warm start (`launch/sft.py`, `configs/sft_textcraft_tiny.py`) and the RL default
(`configs/textcraft_tiny.py`), so both play exactly the same prompts.

Task set: the TextCraft goals selected by `TRAIN` (a task selector in the trainer's syntax,
`configs/base.py`: "key=v1,v2" filters on `env.task_info`). Held-out goals: every
`HOLDOUT_EVERY`-th goal of that set in task-id order (ids listed by `heldout_ids`), never trained on,
validated separately. Training game seeds are `< VAL_SEED_BASE`; the validation panel uses seeds
from `VAL_SEED_BASE` up (new distractor recipes and order).
"""

from __future__ import annotations

GAME = "textcraft"
TRAIN = "depth=2&128:208"     # the default task set: the first 80 depth-2 goals (alphabetical)
HOLDOUT_EVERY = 8             # every 8th goal of the set (by task id) is held out: 10 goals
MAX_STEPS = 15                # step cap per episode
HISTORY_LENGTH = 0            # (observation, action) pairs shown: none, the inventory carries the state
SHOW_INVENTORY = True         # the prompt shows the current inventory (a template option)
SYSTEM_PROMPT = ""            # no system message
FALLBACK_ACTION = "inventory"  # sent to the game for an unparsable response
# A compact prompt (`environments.prompts.PromptTemplate` field overrides, RolloutConfig.template):
# the crafting commands and goal, the step, the last feedback and the inventory; no boilerplate
# (the default template's rules and think instruction are ~120 of its ~340 tokens). The tiny
# actor answers with `<action>...</action>` and no think.
TEMPLATE = {
    "first": "{task}\nStep {current_step}: {observation}{inventory}\nAnswer <action>command</action>.",
    "later": ("{task}\n{history}\nStep {current_step}: {observation}{inventory}\n"
              "Answer <action>command</action>."),
    "history_entry": "Step {index}: {observation} > {action}",
    "task_echo": "start",
}
VAL_SEED_BASE = 1_000_000     # validation game seeds start here; training seeds stay below
VAL_NUM_SEEN = 48             # panel: goals of the training set, unseen seeds
VAL_NUM_HELDOUT = 16          # panel: held-out goals
VAL_TEMPERATURE = 0.4


def select(env, selector: str) -> list[int]:
    """Task ids of `env` matching `selector` ("all" | "a:b" | "3,7" | "key=v1,v2", "&"-joined).

    Raises:
      ValueError: on a malformed selector (names it).
    """
    ids = set(range(env.num_tasks))
    for part in selector.split("&"):
        part = part.strip()
        if part in ("", "all"):
            continue
        if "=" in part:
            key, values = part.split("=", 1)
            allowed = {v.strip() for v in values.split(",")}
            ids &= {t for t in ids if str(env.task_info(t).get(key.strip())) in allowed}
        elif ":" in part:
            a, b = part.split(":", 1)
            ids &= set(range(int(a), int(b)))
        else:
            try:
                ids &= {int(v) for v in part.split(",")}
            except ValueError:
                raise ValueError(f"task selector part {part!r} is not all | a:b | ids | key=values") from None
    return sorted(ids)


def split(env, selector: str = TRAIN, holdout_every: int = HOLDOUT_EVERY) -> tuple[list[int], list[int]]:
    """(training goals, held-out goals) of the task set: every `holdout_every`-th id is held out."""
    ids = select(env, selector)
    held = ids[holdout_every - 1::holdout_every] if holdout_every else []
    held_set = set(held)
    return [t for t in ids if t not in held_set], held


def validation_panel(train_ids, heldout_ids, num_seen: int = VAL_NUM_SEEN,
                     num_heldout: int = VAL_NUM_HELDOUT, seed: int = 0) -> list[tuple[int, int]]:
    """The fixed, seeded validation panel: (task_id, game_seed) pairs.

    `num_seen` goals evenly spaced over the training goals and `num_heldout` over the held-out ones
    (all when fewer), each with its own game seed `VAL_SEED_BASE + seed * 10_000 + k`.
    """
    import numpy as np

    def spread(ids, n):
        if n >= len(ids):
            return list(ids)
        return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, n).round()]

    goals = spread(list(train_ids), num_seen) + spread(list(heldout_ids), num_heldout)
    return [(t, VAL_SEED_BASE + seed * 10_000 + k) for k, t in enumerate(goals)]


def heldout_ids() -> list[int]:
    """The held-out goal ids of the default task set (builds a TextCraft env to read depths)."""
    import environments

    return split(environments.make(GAME, max_steps=MAX_STEPS))[1]
