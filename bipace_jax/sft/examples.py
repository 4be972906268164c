"""Warm-start examples in the RL loop's prompt/response format: the oracle's demonstrations and the
DAgger records, each encoded by ``record_example`` (the prompt as ``rollout.encode_prompt`` builds it,
the response ``<action>{action}</action>`` + ``<|im_end|>``), and the DAgger record files of a run folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from etils import epath

from bipace_jax import demos
from bipace_jax.rollout import RolloutConfig, RolloutResult, encode_prompt
from bipace_jax.tiny import ACTION_RESPONSE, oracle_steps

# -------------------------------------------------------------------------------------------------
# Examples: the RL loop's prompt/response format.


@dataclasses.dataclass
class Example:
    """One behaviour-cloning example: the chat-formatted prompt's token ids and the target response's;
    ``key`` names it (``<task>_<seed>_<turn>``: the dataset's record key; ``dagger<round>_<row>``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    depth: int = 0
    source: str = "expert"
    key: str = ""


def encode_response(tokenizer, action: str) -> list[int]:
    """Token ids of ``<action>{action}</action>`` followed by the end-of-turn token ``<|im_end|>``."""
    ids = tokenizer(ACTION_RESPONSE.format(action=action), add_special_tokens=False)["input_ids"]
    return list(ids) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def expert_examples(env, rcfg: RolloutConfig, tokenizer, pairs: Sequence[tuple[int, int]]):
    """The oracle's episodes on each (task_id, seed) as examples; returns (examples, stats).

    Raises:
      RuntimeError: the oracle has no action before the episode ends (it must always have a plan).
    """
    examples, wins = [], 0
    for s in oracle_steps(env, pairs, rcfg.max_steps):
        if s.action is None:
            raise RuntimeError(f"oracle has no action for task {s.task_id} seed {s.seed} at step {s.step}")
        ids, _ = encode_prompt(tokenizer, rcfg, s.obs, list(s.history), s.step, f"task {s.task_id} seed {s.seed}")
        depth = int(env.task_info(s.task_id).get("depth", 0))
        key = f"{s.task_id}_{s.seed}_{s.step}"
        examples.append(Example(ids, encode_response(tokenizer, s.action), depth, "expert", key))
        wins += bool(s.next_obs.won)
    n = max(len(pairs), 1)
    return examples, {"oracle_win_rate": wins / n, "oracle_mean_length": len(examples) / n}


def record_example(r, rcfg: RolloutConfig, tokenizer) -> Example:
    """The example of one demonstration record: a ``bipace_demos`` record (a ``demos.read_split`` row,
    key ``<task>_<seed>_<turn>``, source ``"expert"``) or a DAgger record (``dagger_records``, key
    ``dagger<round>_<row>``, source ``"dagger"``). The one record -> example encoding of the warm start:
    the prompt as ``rollout.encode_prompt`` encodes the record's observation, history and turn (what the
    RL loop feeds the sampler), the response ``encode_response`` of its oracle action.

    Raises:
      PromptTooLongError: the prompt exceeds ``rcfg.max_prompt_length`` even with no history.
    """
    task, seed, turn = int(r["task_id"]), int(r["seed"]), int(r["turn"])
    ids, _ = encode_prompt(
        tokenizer, rcfg, demos.observation_of(r), demos.history_of(r), turn, f"task {task} seed {seed}"
    )
    action = r["action"].decode() if isinstance(r["action"], bytes) else str(r["action"])
    if "round" in r:
        source, key = "dagger", f"dagger{int(r['round'])}_{int(r['row'])}"
    else:
        source, key = "expert", f"{task}_{seed}_{turn}"
    return Example(ids, encode_response(tokenizer, action), int(r["depth"]), source, key)


def demo_examples(records, rcfg: RolloutConfig, tokenizer) -> tuple[list[Example], dict[str, float]]:
    """Examples of a ``demos.read_split`` source (record order, ``record_example``); returns (examples,
    oracle stats: the share of its episodes won and their mean length in records)."""
    examples, won = [], {}
    for r in records:
        examples.append(record_example(r, rcfg, tokenizer))
        won[(int(r["task_id"]), int(r["seed"]))] = bool(r["won"])
    n = max(len(won), 1)
    return examples, {"oracle_win_rate": sum(won.values()) / n, "oracle_mean_length": len(examples) / n}


def expert_dataset(spec, data_dir: str, progress: bool = False) -> demos.DemosBuilder:
    """The warm start's demonstrations (``bipace_demos``) built under ``data_dir`` on first use: its
    training goals x ``data.expert_seeds`` in ``train``, its held-out goals in ``validation``."""
    cfg = demos.demos_config(
        spec.env.name,
        tasks=spec.tasks.train,
        holdout_every=spec.tasks.holdout_every,
        seeds=spec.data.expert_seeds,
        max_steps=spec.env.max_steps,
    )
    return demos.build(cfg, data_dir, progress=progress)


def dagger_records(res: RolloutResult, rnd: int, game: str) -> list[dict[str, Any]]:
    """The labelled rows of a ``collect`` (DAgger round ``rnd`` of ``game``) as demonstration records
    (``demos.FIELDS`` + ``round``, ``row``), in row order; rows the oracle has no action for are left out.

    Each record holds the state the row's prompt showed (``res.rows[row].state``), its history (the earlier
    rows of its trajectory: observation text and the action sent, as ``collect`` built the prompt), its
    turn, and the oracle's label as ``action``; ``won`` is whether the policy's game was won, ``oracle``
    ``demos.oracle_version(game)``. ``record_example`` of a record gives the row's prompt tokens exactly.

    Raises:
      ValueError: ``res`` has no labels or states (not a labelled ``collect``), or a trajectory's rows are
        not its steps 0, 1, ... in order.
    """
    if not res.labeled or any(row.state is None for row in res.rows):
        raise ValueError("dagger_records needs a RolloutResult of collect(..., labeler=...) with its states")
    oracle, out = demos.oracle_version(game), []
    history: dict[int, list[tuple[str, str]]] = {}
    for r, row in enumerate(res.rows):
        t = row.traj
        past = history.setdefault(t, [])
        if row.step != len(past):
            raise ValueError(f"row {r}: trajectory {t} step {row.step} follows {len(past)} earlier rows")
        if row.label is not None:
            ep = res.episodes[t]
            depth = int(ep.task_info.get("depth", 0))
            out.append(
                demos.record(
                    game,
                    ep.task_id,
                    ep.seed,
                    row.step,
                    depth,
                    row.state,
                    past,
                    row.label,
                    ep.won,
                    oracle,
                    round=rnd,
                    row=r,
                )
            )
        past.append((row.observation, row.action))
    return out


def dagger_file(run_dir: epath.Path, rnd: int) -> epath.Path:
    """Round ``rnd``'s DAgger records in the run folder (``demos.write_records``' JSON lines)."""
    return run_dir / f"dagger_{rnd}.jsonl"


def read_dagger_examples(run_dir: epath.Path, rnd: int, rcfg: RolloutConfig, tokenizer) -> list[Example]:
    """``record_example`` of each of round ``rnd``'s DAgger records in the run folder, in record order.

    Raises:
      ValueError: the round's file (``dagger_file``) does not exist (the message says when the folder holds
        ``dagger_<round>.json`` instead, the token-id format of older versions, which is not read), or a
        record lacks a field.
    """
    path = dagger_file(run_dir, rnd)
    if not path.exists():
        old = run_dir / f"dagger_{rnd}.json"
        why = (
            f"the folder holds {old.name}, the token-id format of an older version, which is not read"
            if old.exists()
            else "the run folder lost it"
        )
        raise ValueError(f"DAgger round {rnd} is finished but {path} does not exist ({why}): start a new --workdir")
    records = demos.read_records(path, demos.FIELDS + demos.DAGGER_FIELDS)
    return [record_example(r, rcfg, tokenizer) for r in records]


#: ``config.train.log_examples``' file in the run folder: one JSON line per update.
