"""How long the shared prompt head of a task group is, for the paper games' default prompts.

    python -m launch.head_lengths                 # table + benchmarks/shared_heads.json

For each game (ALFWorld on its bundled fixture games, WebShop on its bundled sample catalogue,
TextCraft on its goals; nothing is downloaded) two games of one task group (same task id and seed)
play ``--turns`` turns with different actions from turn 1 (the worst case for sharing: games that
agree longer share more). Each turn's prompt is what the rollout feeds the sampler: the game's
default template at the paper setting (``history_length`` 2, no inventory), inside the bundled
Qwen2.5 chat template with its default system message (``rollout.chat_prompt_ids``). The shared
head is the two prompts' longest common prefix, measured in characters, in tokens of a byte-level
BPE trained on these prompts (vocabulary 1200, as tests/test_rollout.py's fixture), and in
Qwen2.5 tokens estimated as pre-tokens of Qwen2's split pattern (every pre-token is at least one
token, and Qwen2.5's 151,643-token vocabulary holds nearly every English word with its leading
space whole, so this is a slight under-count). The chars-per-token ratio it gives is reported
per game.

Writes ``--out``: per game and turn the prompt and head lengths in all three units, the
layout (what the head holds), and per game the mean head fraction over turns 3..k.
"""

from __future__ import annotations

import os

import numpy as np
import regex
from absl import app, flags

import environments
from bipace_jax import tiny
from bipace_jax.models.tokenizer import qwen2_5_chat_template
from bipace_jax.sampling.heads import common_prefix_length
from environments import alfworld as alf
from environments.prompts import build_prompt
from launch import cli
from launch._common import ROOT, write_json


def _define_flags():
    # defined only when run as a script: tests import this module beside other launch modules' `--out`
    global _TURNS, _TASKS, _OUT
    _TURNS = flags.DEFINE_integer("turns", 6, "Turns each game plays (prompts measured at turns 1..k).")
    _TASKS = flags.DEFINE_integer("tasks", 3, "Task groups measured per game.")
    _OUT = flags.DEFINE_string("out", os.path.join(ROOT, "benchmarks", "shared_heads.json"), "JSON report path.")


# Qwen2's pre-tokenizer split (its tokenizer.json "Split" pattern): words with a leading space or
# punctuation, single digits, punctuation runs, new-line runs, spaces
QWEN2_SPLIT = regex.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
HISTORY_LENGTH = 2  # the paper configs' rollout.history_length (verl-agent's)


def qwen_pretokens(text: str) -> int:
    """Pre-tokens of ``text`` under Qwen2's split pattern: a lower bound on its Qwen2.5 token count."""
    return len(QWEN2_SPLIT.findall(text))


def make_env(game: str):
    if game == "alfworld":
        return environments.make("alfworld", max_steps=50, expert_type=None, data_path=alf.FIXTURES_DIR)
    if game == "webshop":
        return environments.make("webshop", data_dir="sample", split="test")
    return environments.make("textcraft", max_steps=50)


def pick(obs, turn: int, which: int, task: str, oracle: str | None) -> str:
    """Game A's or B's action: admissible actions at different indices (a search query of different
    task words for WebShop's search bar); TextCraft lists none: A the oracle's, B 'inventory' first."""
    acts = [a for a in (obs.admissible_actions or []) if a != "help"]
    if not acts:
        return (oracle or "inventory") if which == 0 or turn > 0 else "inventory"
    a = acts[(3 * turn + which) % len(acts)]
    if a.startswith("search["):
        words = task.split()
        return f"search[{' '.join(words[:6] if which == 0 else words[-6:])}]"
    return a


def play_pair(game: str, task_id: int, turns: int) -> list[tuple[str, str]]:
    """The (prompt A, prompt B) user texts of two games of one group at turns 1..``turns`` (fewer when
    one game ends)."""
    envs = [make_env(game), make_env(game)]
    try:
        obs = [e.reset(task_id, 7) for e in envs]
        hist: list[list[tuple[str, str]]] = [[], []]
        out = []
        for t in range(turns):
            texts = [
                build_prompt(game, obs[i], hist[i][-HISTORY_LENGTH:], t, history_length=HISTORY_LENGTH)
                for i in range(2)
            ]
            out.append((texts[0], texts[1]))
            done = False
            for i, e in enumerate(envs):
                oracle = e.oracle_action() if game == "textcraft" else None
                a = pick(obs[i], t, i, obs[i].task, oracle)
                hist[i].append((obs[i].text, a))
                obs[i], _, d, _ = e.step(a)
                done = done or d
            if done:
                break
        return out
    finally:
        for e in envs:
            getattr(e, "close", lambda: None)()


def chat(text: str, tokenizer) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def train_tokenizer(corpus: list[str]):
    """The byte-level BPE the lengths are counted in: 1,200 tokens learnt from ``corpus`` (every pair
    merged, no added tags), Qwen's special tokens, Qwen2.5's chat template."""
    return tiny.train_tokenizer(
        corpus, vocab_size=1200, tags=(), min_frequency=0, chat_template=qwen2_5_chat_template(), model_max_length=None
    )


def measure(turns: int, tasks: int) -> dict:
    # chat-wrapped texts need a tokenizer with the template: any one renders the same text
    games = {}
    for game in ("alfworld", "webshop", "textcraft"):
        games[game] = [play_pair(game, task, turns) for task in range(tasks)]
    render = train_tokenizer(["x"])
    texts = {g: [[(chat(a, render), chat(b, render)) for a, b in pairs] for pairs in v] for g, v in games.items()}
    corpus = [s for v in texts.values() for pairs in v for pair in pairs for s in pair]
    tok = train_tokenizer(corpus)
    out = {}
    for game, per_task in texts.items():
        rows = []
        for task, pairs in enumerate(per_task):
            for turn, (a, b) in enumerate(pairs, start=1):
                ca = common_prefix_length([np.frombuffer(a.encode(), np.uint8), np.frombuffer(b.encode(), np.uint8)])
                head = a.encode()[:ca].decode(errors="ignore")
                ids = [np.asarray(tok(s, add_special_tokens=False)["input_ids"]) for s in (a, b)]
                rows.append(
                    dict(
                        task=task,
                        turn=turn,
                        prompt_chars=len(a),
                        head_chars=len(head),
                        prompt_bpe=int(ids[0].size),
                        head_bpe=common_prefix_length(ids),
                        prompt_qwen=qwen_pretokens(a),
                        prompt_qwen_other=qwen_pretokens(b),
                        head_qwen=qwen_pretokens(head),
                        head_fraction_qwen=qwen_pretokens(head) / qwen_pretokens(a),
                        head_ends_with=head[-60:],
                    )
                )
        late = [r for r in rows if r["turn"] >= 3]
        chars = sum(r["prompt_chars"] for r in rows)
        out[game] = dict(
            rows=rows,
            chars_per_qwen_token=chars / sum(r["prompt_qwen"] for r in rows),
            chars_per_bpe_token=chars / sum(r["prompt_bpe"] for r in rows),
            head_qwen_turn1=float(np.mean([r["head_qwen"] for r in rows if r["turn"] == 1])),
            head_qwen_turn2=float(np.mean([r["head_qwen"] for r in rows if r["turn"] == 2])),
            head_qwen_later=float(np.mean([r["head_qwen"] for r in late])),
            prompt_qwen_later=float(np.mean([r["prompt_qwen"] for r in late])),
            head_fraction_later=float(np.mean([r["head_fraction_qwen"] for r in late])),
            # the longer row's rest after the head: what a suffix width Ts must hold
            suffix_qwen_later=float(
                np.mean([max(r["prompt_qwen"], r["prompt_qwen_other"]) - r["head_qwen"] for r in late])
            ),
            longest_prompt_qwen_later=max(max(r["prompt_qwen"], r["prompt_qwen_other"]) for r in late),
        )
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    out = measure(_TURNS.value, _TASKS.value)
    print(
        "| game | chars / Qwen token | head, Qwen tokens: turn 1 / turn 2 / turns 3+ | prompt, turns 3+: mean / longest "
        "| longer row's suffix, turns 3+ | head share, turns 3+ |"
    )
    print("|---|---|---|---|---|---|")
    for g, v in out.items():
        print(
            f"| {g} | {v['chars_per_qwen_token']:.2f} | {v['head_qwen_turn1']:.0f} / {v['head_qwen_turn2']:.0f} / "
            f"{v['head_qwen_later']:.0f} | {v['prompt_qwen_later']:.0f} / {v['longest_prompt_qwen_later']} | "
            f"{v['suffix_qwen_later']:.0f} | {v['head_fraction_later']:.2f} |"
        )
    write_json(
        _OUT.value,
        dict(
            method="launch.head_lengths: two games of one task group, different actions from turn 1, default "
            "templates (history_length 2) in the bundled Qwen2.5 chat template; head = longest common prefix; "
            "Qwen tokens = Qwen2 split-pattern pre-tokens (a lower bound)",
            turns=_TURNS.value,
            tasks=_TASKS.value,
            games=out,
        ),
        indent=1,
    )


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
