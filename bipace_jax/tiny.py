"""The embedded default's tokenizer and actor shape: a small byte-level BPE and a tiny Qwen2, built
from text the project generates itself (nothing is downloaded).

The tokenizer is a byte-level BPE (Hugging Face ``tokenizers``) wrapped as a
``transformers.PreTrainedTokenizerFast`` with a ChatML chat template (Qwen2.5's
``<|im_start|>role\\ncontent<|im_end|>\\n`` without its default system prompt). On top of the merges
it carries *phrase tokens*: whole multi-word names (TextCraft items such as ``"oak planks"``) as
single non-special tokens, matched leftmost-longest in the raw text. An item name is then one token
in the recipes, the goal, the inventory and the action, so copying it into an action is one pointer,
not a sequence of sub-word pieces (copying the wrong item is a tiny model's main failure).
Encoding and decoding are exact inverses on any text, phrase tokens included.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import environments
from bipace_jax.config import resolve_template
from bipace_jax.models import Qwen2Config, load_tokenizer
from environments.prompts import build_prompt

# Chat-template special tokens (the Qwen2.5 names; ids are this tokenizer's own, 0, 1, 2).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Non-special tags of the prompt/response format, each one token (the sampler stops on "</action>").
TAG_TOKENS = ("<action>", "</action>", "<think>", "</think>")

# The assistant turn of the warm start's data and the tokenizer corpus (no think for the tiny actor).
ACTION_RESPONSE = "<action>{action}</action>"

# ChatML without Qwen2.5's default system prompt ("You are Qwen, ..."): a conversation without a
# system message gets none. `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def train_bpe(corpus: Iterable[str], *, vocab_size: int, min_frequency: int = 0):
    """The byte-level BPE (Hugging Face ``tokenizers``) learnt from ``corpus``: ``vocab_size`` tokens in
    all (256 byte symbols, Qwen2.5's special tokens ``SPECIAL_TOKENS`` as ids 0, 1, 2, then merges of pairs
    seen at least ``min_frequency`` times), no prefix space. Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=min_frequency,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def train_tokenizer(
    corpus: Iterable[str],
    *,
    vocab_size: int = 1024,
    phrase_tokens: Sequence[str] = (),
    tags: Sequence[str] = TAG_TOKENS,
    min_frequency: int = 2,
    chat_template: str | None = CHAT_TEMPLATE,
    model_max_length: int | None = 4096,
):
    """Train a byte-level BPE on ``corpus`` and wrap it with the chat template.

    Args:
      corpus: training texts (str); every byte value stays encodable whatever the corpus.
      vocab_size: size of the learned BPE part (256 byte symbols + merges + 3 special tokens); phrase
        and tag tokens come on top (``len(tokenizer)`` about ``vocab_size + len(phrase_tokens) + 4``).
      phrase_tokens: exact strings (e.g. ``"oak planks"``) added as single non-special tokens.
      tags: non-special tokens added before the phrases (default the prompt/response tags).
      min_frequency: pairs seen fewer times are not merged.
      chat_template: set on the tokenizer (None: none; ``load_tokenizer`` then adds Qwen2.5's).
      model_max_length: recorded in the tokenizer config (None: transformers' default).

    Returns a ``transformers.PreTrainedTokenizerFast``: EOS ``<|im_end|>``, pad ``<|endoftext|>``, no BOS.

    Raises:
      ValueError: if ``vocab_size`` < 300 (the 256 byte symbols plus room for merges) or a phrase
        token is empty or repeated.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte symbols + merges), got {vocab_size}")
    phrases = list(phrase_tokens)
    if any(not p for p in phrases):
        raise ValueError("phrase_tokens must be non-empty strings")
    if len(set(phrases)) != len(phrases):
        raise ValueError("phrase_tokens must be distinct")

    tok = train_bpe(corpus, vocab_size=vocab_size, min_frequency=min_frequency)
    if tags or phrases:  # tags first, then phrases: their ids follow the BPE's in this order
        tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in [*tags, *phrases]])
    kw = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        **kw,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def tiny_actor_config(vocab_size: int, *, eos_token_id: int | None, **sizes) -> Qwen2Config:
    """The one builder of a small random-init Qwen2 architecture: RL's ``model.preset = "tiny"``
    (``build.actor_architecture``) and the warm start's actor. ``Qwen2Config.tiny`` (tied embeddings,
    RoPE theta 10,000, RMSNorm eps 1e-6, fp32) with ``vocab_size``, ``eos_token_id`` (None:
    ``Qwen2Config.tiny``'s) and ``sizes`` (``hidden_size``, ``num_hidden_layers``, ... by keyword).

    Raises:
      ValueError: (from ``Qwen2Config``) a field out of range, e.g. ``vocab_size`` < 1 or ``hidden_size``
        not divisible by the head count.
    """
    eos = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    return Qwen2Config.tiny(vocab_size=vocab_size, **eos, **sizes)


def random_hf_qwen2(config: Qwen2Config, *, seed: int = 0, weight_std: float = 0.05, path: str | None = None):
    """A random fp32 Hugging Face ``Qwen2ForCausalLM`` (torch, eval mode) of ``config``; nothing is downloaded.

    Every weight is redrawn from N(0, ``weight_std``) after ``torch.manual_seed(seed)``, RMSNorm scales
    from 1 + N(0, ``weight_std``). With ``path``, the model is also saved there (config.json +
    model.safetensors, loadable by ``load_hf_checkpoint``).
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen2Config(**config.to_hf_dict(torch_dtype="float32"))
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape) * weight_std
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    if path is not None:
        model.save_pretrained(path)
    return model


class OracleStep(NamedTuple):
    """One step of an oracle episode: the state shown (``obs``, earlier ``history``, ``step``), the
    oracle's ``action`` (None: it has none; the episode ends there) and the observation it led to."""

    task_id: int
    seed: int
    step: int
    obs: Any
    history: tuple[tuple[str, str], ...]
    action: str | None
    next_obs: Any = None


def oracle_steps(env, pairs: Iterable[tuple[int, int]], max_steps: int) -> Iterator[OracleStep]:
    """Plays ``env.oracle_action()`` on each (task_id, seed) until the game ends, ``max_steps`` steps
    or the oracle has no action, yielding every state visited."""
    for task_id, seed in pairs:
        obs, history = env.reset(task_id, seed), []
        for step in range(max_steps):
            action = env.oracle_action()
            if action is None:
                yield OracleStep(task_id, seed, step, obs, tuple(history), None)
                break
            new_obs, _, done, _ = env.step(action)
            yield OracleStep(task_id, seed, step, obs, tuple(history), action, new_obs)
            history.append((obs.text, action))
            obs = new_obs
            if done:
                break


def oracle_corpus(
    env,
    pairs: Iterable[tuple[int, int]],
    prompts: Callable[[OracleStep], list[str]],
    *,
    max_steps: int,
    response: str = ACTION_RESPONSE,
    feedback: bool = False,
) -> list[str]:
    """Tokenizer corpus of oracle episodes: per step ``prompts(step)``, the response (``response``
    formatted with the action) and, with ``feedback``, the game's reply."""
    texts = []
    for s in oracle_steps(env, pairs, max_steps):
        texts += prompts(s)
        if s.action is not None:
            texts.append(response.format(action=s.action))
            if feedback:
                texts.append(s.next_obs.text)
    return texts


_RECIPE = re.compile(r"^craft (\d+) (.+?) using (.+)$")
_INGREDIENT = re.compile(r"^(\d+) (.+)$")


def item_names(lines: Iterable[str]) -> list[str]:
    """Item names (output and ingredients) of the TextCraft recipe lines among ``lines``, sorted."""
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


def warm_start_tokenizer(
    game: str,
    template: Any,
    *,
    vocab_size: int = 1024,
    seeds: int = 2,
    task_ids: Iterable[int] | None = None,
    max_steps: int = 40,
):
    """The warm start's tokenizer: BPE over oracle games on every goal (all by default) x ``seeds``,
    plus one token per item name of the recipe lines (about 620 for TextCraft) and the tags.

    The corpus per step: the prompt in the game's default template (history 1, inventory shown on
    alternate steps), the prompt in ``template`` (history 0, inventory), the response and the feedback.
    Deterministic: the same arguments give the same ``tokenizer.json``.
    """
    env = environments.make(game, max_steps=max_steps)
    ids = range(env.num_tasks) if task_ids is None else task_ids
    pairs = [(t, s) for t in ids for s in range(seeds)]

    recipe_lines = set()

    def prompts(s: OracleStep) -> list[str]:
        if s.step == 0:
            recipe_lines.update(line for line in s.obs.text.splitlines() if line.startswith("craft "))
        show = bool((s.task_id + s.seed + s.step) % 2)
        return [
            build_prompt(game, s.obs, s.history, s.step, history_length=1, show_inventory=show),
            build_prompt(game, s.obs, s.history, s.step, history_length=0, show_inventory=True, template=template),
        ]

    texts = ["user", "assistant", "system"] * 100
    texts += oracle_corpus(env, pairs, prompts, max_steps=max_steps, feedback=True)
    return train_tokenizer(texts, vocab_size=vocab_size, phrase_tokens=item_names(recipe_lines))


def build_game_tokenizer(config, path: str, num_tasks: int = 64):
    """Train a small byte-level BPE on the game's own text and save it as an HF tokenizer folder.

    For a run config without a tokenizer (random tiny init): the corpus is the prompts (the config's
    template and options) and expert actions of ``num_tasks`` oracle episodes of ``config.env``, so
    the vocabulary fits the game. Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``,
    ``<|im_end|>`` (EOS of a response); the Qwen2.5 chat template is added by ``load_tokenizer``.
    Deterministic for a config. Returns the loaded tokenizer.
    """
    game, r = config.env.name, config.rollout
    env = environments.make(game, max_steps=config.env.max_steps)
    template = resolve_template(r.template)
    pairs = [((i * 7919) % env.num_tasks, i) for i in range(num_tasks)]

    prompt = functools.partial(build_prompt, game, template=template, show_inventory=r.show_inventory)

    def prompts(s: OracleStep) -> list[str]:
        return [prompt(s.obs, s.history, s.step, history_length=min(r.history_length, len(s.history)))]

    texts = oracle_corpus(
        env,
        pairs,
        prompts,
        max_steps=config.env.max_steps,
        response="<think>I will {action}.</think><action>{action}</action>",
    )
    texts.append("You are a helpful assistant. system user assistant")
    tok = train_tokenizer(
        texts, vocab_size=config.model.vocab_size, tags=(), min_frequency=0, chat_template=None, model_max_length=None
    )
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    return load_tokenizer(path)
