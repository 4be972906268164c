r"""Build the embedded default's tokenizer from TextCraft text the project generates itself.

    python -m launch.build_tokenizer --out=/tmp/tok [--vocab_size=1024] [--seeds=2]

The corpus is what the agent will read and write: for every one of the 419 TextCraft goals and a
few seeds, the prompts of the oracle's episode (`environments.prompts.build_prompt`, with and
without the inventory display), the oracle's actions in the response format, and the game's
feedback. Every item name seen in a recipe line ("craft 4 oak planks using 1 oak log") becomes one
whole token, without its leading space, so the same token names the item in a recipe line, the
goal, the inventory display ("[oak planks] (4)") and an action (see `bipace_jax.tiny`).
Deterministic: the same arguments give the same `tokenizer.json`.
"""

from __future__ import annotations

import re
from typing import Iterable

_RECIPE = re.compile(r"^craft (\d+) (.+?) using (.+)$")
_INGREDIENT = re.compile(r"^(\d+) (.+)$")


def item_names(lines: Iterable[str]) -> list[str]:
    """Item names (output and ingredients) of the recipe lines among `lines`, sorted."""
    names = set()
    for line in lines:
        m = _RECIPE.match(line.strip())
        if not m:
            continue
        names.add(m.group(2))
        for part in m.group(3).split(","):
            mi = _INGREDIENT.match(part.strip())
            if mi:
                names.add(mi.group(2))
    return sorted(names)


def textcraft_corpus(seeds: int = 2, history_length: int = 1, max_steps: int = 40,
                     task_ids: Iterable[int] | None = None):
    """Texts of oracle episodes on TextCraft goals (all 419 by default) x `seeds` seeds.

    Returns:
      (texts, recipe_lines): the prompts, responses and feedback strings; the recipe lines seen.

    Raises:
      RuntimeError: if the oracle has no action in some state.
    """
    import environments
    from environments.prompts import build_prompt

    from configs.textcraft_tasks import TEMPLATE
    from launch.sft import response_text

    env = environments.make("textcraft", max_steps=max_steps)
    texts, recipe_lines = ["user", "assistant", "system"] * 100, set()
    ids = range(env.num_tasks) if task_ids is None else task_ids
    for task_id in ids:
        for seed in range(seeds):
            obs = env.reset(task_id, seed)
            for line in obs.text.splitlines():
                if line.startswith("craft "):
                    recipe_lines.add(line)
            history, done, step = [], False, 0
            while not done:
                action = env.oracle_action()
                if action is None:
                    raise RuntimeError(f"oracle has no action: task {task_id}, seed {seed}")
                show = bool((task_id + seed + step) % 2)
                texts.append(build_prompt("textcraft", obs, history, step,
                                          history_length=history_length, show_inventory=show))
                texts.append(build_prompt("textcraft", obs, history, step, history_length=0,
                                          show_inventory=True, template=TEMPLATE))
                texts.append(response_text(action))
                history.append((obs.text, action))
                obs, _, done, _ = env.step(action)
                texts.append(obs.text)
                step += 1
    return texts, sorted(recipe_lines)


def build_textcraft_tokenizer(vocab_size: int = 1024, seeds: int = 2):
    """The embedded default's tokenizer (`transformers.PreTrainedTokenizerFast`).

    BPE with `vocab_size` learned entries over the TextCraft corpus, plus one token per item name
    (about 620: the names in the recipe lines of the 419 goals) and the tags; the chat template is
    ChatML without a default system prompt.
    """
    from bipace_jax.tiny import train_tokenizer

    texts, recipe_lines = textcraft_corpus(seeds=seeds)
    names = item_names(recipe_lines)
    return train_tokenizer(texts, vocab_size=vocab_size, phrase_tokens=names)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the tokenizer into")
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    tok = build_textcraft_tokenizer(args.vocab_size, args.seeds)
    tok.save_pretrained(args.out)
    print(f"tokenizer with {len(tok)} tokens written to {args.out}")


if __name__ == "__main__":
    main()
