"""Episode transcripts: what the agent saw, said and did, one JSON line per step in ``episodes/<i>.jsonl``.

``i`` is the number of policy updates before the games were played: ``episodes/0.jsonl`` holds the
first iteration's rollouts and the before-RL validation, ``episodes/10.jsonl`` the validation after
ten iterations (the ``x`` of the plots). A file holds the phases played at ``i``: ``"rollout"``
(training games, with advantages) and the validation panels ``"val"`` / ``"val/holdout"``; writing a
phase again replaces its lines (a re-run iteration after a resume leaves no duplicates).

Each line (``step_rows``): ``iteration``, ``phase``, ``game`` (the game's number in its phase, over
all hosts), ``host``, ``task_id``, ``seed``, ``group`` (task group), ``turn``, ``prompt_hash``
(sha256 of the prompt token ids, 16 hex digits), ``prompt_tokens``, ``prompt`` (the whole prompt
text, on turn 0 only: later prompts repeat its frame), ``observation`` (the game text the prompt
ends with), ``response``, ``action`` (the command sent), ``valid``, ``finish``, ``reward`` (the net
step reward: success part minus the invalid-action penalty), ``penalty``, ``return`` (the
discounted return-to-go of the net rewards at ``gamma``), ``won``, ``episode_return``, ``episode_length``
and, for training rollouts (else null): ``advantage``, ``step_group`` (the estimator's step group /
cluster label, -1 = none) and ``pace_kind`` (``"pace"``, ``"loo"`` (leave-one-out), ``"singleton"``,
``"group"`` (a plain step-group baseline), ``"none"`` (no step level: grpo) or ``"excluded"`` (a
row the estimator left out: its trajectory failed the estimator's checks)); ``policy_version`` (the
learner updates behind the parameters that sampled the row: ``iteration`` minus it is the row's
version lag under asynchronous RL, 0 on-policy). Branching rollouts
(``rollout.branch_turns``) add ``branch`` (the game's sibling index at each fork before this turn) and
``repeated`` (the row repeats its parent's turn before the fork: sampled once, by the parent).

Files are written whole through ``runfolder`` (local or ``gs://``) by process 0, with the rows of
every process (``gather``); each process offers its first ``ceil(max_games / processes)`` games.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from bipace_jax import distributed, runfolder

__all__ = ["EPISODES", "gather", "iterations", "read", "render", "step_rows", "write"]

EPISODES = "episodes"  # the run folder's transcript folder
ROLLOUT = "rollout"  # the phase of training games
_KINDS = {1: "loo", 2: "pace"}  # estimators.core.LOO_ROW / PACE_ROW


def _returns(net: np.ndarray, traj: np.ndarray, gamma: float) -> np.ndarray:
    """float64[N] discounted return-to-go of each row within its trajectory (rows in step order per traj)."""
    out = np.zeros(net.shape, np.float64)
    for t in np.unique(traj):
        idx = np.flatnonzero(traj == t)
        acc = 0.0
        for i in idx[::-1]:
            acc = float(net[i]) + gamma * acc
            out[i] = acc
    return out


def _pace_kinds(labels: np.ndarray, kinds: np.ndarray) -> list[str]:
    """Each row's step-level branch from the estimator's labels and row kinds (``step_details``)."""
    valid = labels[kinds >= 0]
    counts = dict(zip(*np.unique(valid[valid >= 0], return_counts=True)))
    out = []
    for lab, kind in zip(labels, kinds):
        if kind < 0:
            out.append("excluded")
        elif kind in _KINDS:
            out.append(_KINDS[int(kind)])
        elif lab < 0:
            out.append("none")
        else:
            out.append("singleton" if counts.get(lab, 0) == 1 else "group")
    return out


def step_rows(
    res,
    tokenizer,
    *,
    iteration: int,
    phase: str,
    gamma: float,
    max_games: int,
    advantages: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    kinds: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """The transcript lines of one ``rollout.collect`` result: its first ``max_games`` games with rows
    (trajectory order), one dict per step, fields as in the module docstring.

    Args:
      res: a ``RolloutResult``.
      tokenizer: its tokenizer (decodes the turn-0 prompts).
      iteration, phase: written on every line.
      gamma: discount of ``return`` (the estimator's ``gamma``).
      max_games: the most games kept (>= 1).
      advantages: float[N] per token row (``RolloutResult.row_values`` of the estimator's output), or None.
      labels, kinds: int[N] per token row, the estimator's ``step_details``, or None.

    Raises:
      ValueError: ``max_games`` < 1, or a per-row array that is not one value per token row.
    """
    n = res.num_rows
    if max_games < 1:
        raise ValueError(f"step_rows: max_games must be >= 1, got {max_games}")
    for name, a in (("advantages", advantages), ("labels", labels), ("kinds", kinds)):
        if a is not None and np.shape(a) != (n,):
            raise ValueError(f"step_rows: {name} must be one value per token row ({n},), got {np.shape(a)}")
    s = res.steps
    traj, step, group = (np.asarray(x)[:n] for x in (s.traj_id, s.step, s.group_id))
    reward, penalty = (np.asarray(x, np.float64)[:n] for x in (s.reward, s.penalty))
    net = reward - penalty
    ret = _returns(net, traj, gamma)
    pace = _pace_kinds(np.asarray(labels), np.asarray(kinds)) if labels is not None and kinds is not None else None
    keep = set(sorted(set(traj.tolist()))[:max_games])
    episodes = {e.traj_id: e for e in res.episodes}
    out = []
    for r, row in enumerate(res.rows):
        t = int(traj[r])
        if t not in keep:
            continue
        ep = episodes[t]
        ids = res.prompt_ids[r][res.prompt_mask[r] == 1].astype(np.int32)
        line = {
            "iteration": int(iteration),
            "phase": phase,
            "game": t,
            "host": 0,
            "task_id": int(ep.task_id),
            "seed": int(ep.seed),
            "group": int(group[r]),
            "turn": int(step[r]),
            "prompt_hash": hashlib.sha256(ids.tobytes()).hexdigest()[:16],
            "prompt_tokens": int(ids.size),
            "prompt": tokenizer.decode(ids.tolist()) if step[r] == 0 else None,
            "observation": row.observation,
            "response": row.text,
            "action": row.action,
            "valid": bool(row.valid),
            "finish": row.finish,
            "reward": float(net[r]),
            "penalty": float(penalty[r]),
            "return": float(ret[r]),
            "won": bool(ep.won),
            "episode_return": float(ep.episode_return),
            "episode_length": int(ep.length),
            "advantage": None if advantages is None else float(advantages[r]),
            "step_group": None if labels is None else int(labels[r]),
            "pace_kind": None if pace is None else pace[r],
            "policy_version": int(row.policy_version),
        }
        if s.source_row is not None:  # branching: the game's place in its task group's tree
            line.update(branch=list(row.branch), repeated=row.source is not None)
        out.append(line)
    return out


def gather(rows: list[dict[str, Any]], max_games: int) -> list[dict[str, Any]]:
    """Every process's rows, on every process (a collective: all processes of the group call it,
    `distributed.set_group`), in process order, each process's first ``ceil(max_games / processes)``
    games, ``host`` set and ``game`` renumbered over all processes (0, 1, ... in order)."""
    hosts, me = distributed.process_count(), distributed.process_index()
    quota = math.ceil(max_games / hosts)
    mine = sorted({r["game"] for r in rows})[:quota]
    local = [dict(r, host=me) for r in rows if r["game"] in mine]
    if hosts > 1:
        blob = np.frombuffer(json.dumps(local).encode(), np.uint8)
        sizes = distributed.allgather(np.array([blob.size], np.int64))[:, 0]
        padded = np.zeros((int(sizes.max()),), np.uint8)
        padded[: blob.size] = blob
        blobs = distributed.allgather(padded)
        local = [r for h in range(hosts) for r in json.loads(blobs[h, : sizes[h]].tobytes().decode())]
    numbers: dict[tuple[int, int], int] = {}
    for r in local:
        r["game"] = numbers.setdefault((r["host"], r["game"]), len(numbers))
    return [r for r in local if r["game"] < max_games]


def path(workdir: str, iteration: int):
    """``<workdir>/episodes/<iteration>.jsonl`` as an ``epath.Path``."""
    return runfolder.path(workdir) / EPISODES / f"{int(iteration)}.jsonl"


def write(workdir: str, iteration: int, phase: str, rows: Sequence[dict[str, Any]]) -> None:
    """Replace phase ``phase``'s lines of ``episodes/<iteration>.jsonl`` with ``rows`` (the file is
    rewritten whole, its other phases kept)."""
    p = path(workdir, iteration)
    kept = [r for r in read(workdir, iteration) if r["phase"] != phase]
    p.parent.mkdir(parents=True, exist_ok=True)
    runfolder.write_text(p, "".join(json.dumps(r) + "\n" for r in [*kept, *rows]))


def iterations(workdir: str) -> list[int]:
    """The iterations that have a transcript file, ascending."""
    folder = runfolder.path(workdir) / EPISODES
    if not folder.exists():
        return []
    return sorted(int(m.group(1)) for f in folder.iterdir() if (m := re.fullmatch(r"(\d+)\.jsonl", f.name)))


def read(workdir: str, iteration: int | None = None) -> list[dict[str, Any]]:
    """The lines of ``episodes/<iteration>.jsonl`` ([] when there is none), or of every file when None."""
    if iteration is None:
        return [r for i in iterations(workdir) for r in read(workdir, i)]
    text = runfolder.read_text(path(workdir, iteration)) or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _value(v, fmt: str = "{:+.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(rows: Sequence[dict[str, Any]], game: int | None = None, phase: str | None = None) -> str:
    """A readable text of the transcript ``rows``: per game a header (phase, task, seed, outcome), the
    turn-0 prompt, then each turn's observation, response, action and numbers. ``game`` / ``phase``
    keep only that game number / phase. Returns "" when no row is left."""
    rows = [r for r in rows if (game is None or r["game"] == game) and (phase is None or r["phase"] == phase)]
    games: dict[tuple, list[dict]] = {}
    for r in rows:
        games.setdefault((r["iteration"], r["phase"], r["game"]), []).append(r)
    out = []
    for (it, ph, g), steps in games.items():
        first = steps[0]
        outcome = "won" if first["won"] else "lost"
        out.append(
            f"=== iteration {it} {ph} game {g}: task {first['task_id']} seed {first['seed']} (group "
            f"{first['group']}, host {first['host']}) {outcome} in {first['episode_length']} steps, "
            f"return {first['episode_return']:+.3f}"
        )
        if first.get("prompt"):
            out.append("--- prompt (turn 0)\n" + first["prompt"].rstrip())
        for r in sorted(steps, key=lambda r: r["turn"]):
            out.append(f"--- turn {r['turn']}")
            if r.get("observation") is not None and not (r["turn"] == 0 and r.get("prompt")):  # the prompt shows it
                out.append("observation: " + r["observation"].rstrip())
            out.append("response: " + r["response"].rstrip())
            valid = "" if r.get("valid") is not False else " (invalid)"
            out.append(f"action: {r['action']}{valid}")
            nums = f"reward {r['reward']:+.3f}  return {r['return']:+.3f}  advantage {_value(r.get('advantage'))}"
            if r.get("step_group") is not None:
                nums += f"  step group {r['step_group']} ({r['pace_kind']})"
            lag = it - r.get("policy_version", it)
            if lag:  # asynchronous RL: sampled by an older policy than the one it trains
                nums += f"  sampled by version {r['policy_version']} (lag {lag})"
            out.append(nums)
        out.append("")
    return "\n".join(out)
