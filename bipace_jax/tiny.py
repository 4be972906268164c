"""The embedded default's tokenizer and actor shape: a small byte-level BPE and a tiny Qwen2.

Everything here is built by the project from text it generates itself; nothing is downloaded.

The tokenizer is a byte-level BPE (Hugging Face ``tokenizers``) wrapped as a
``transformers.PreTrainedTokenizerFast`` with a ChatML chat template (the Qwen2.5 format:
``<|im_start|>role\\ncontent<|im_end|>\\n``) that, unlike Qwen2.5's, inserts no default system
prompt, so prompts stay short. On top of the learned merges it carries *phrase tokens*: whole
multi-word names (TextCraft item names such as ``"oak planks"``) added as single, non-special
tokens, matched leftmost-longest in the raw text ("mossy cobblestone slab" wins over "mossy
cobblestone"). A recipe line then costs a handful of tokens, the same token names an item in the
recipes, the goal, the inventory and the action, and copying an item name from the prompt into an
action is one pointer, not a sequence of sub-word pieces: the main failure of a tiny model trained
from scratch is copying the wrong item (issue 7's probe).

Encoding and decoding are exact inverses on any text (byte-level), including phrase tokens.
"""

from __future__ import annotations

from typing import Iterable, Sequence

# Chat-template special tokens (the Qwen2.5 names; ids are this tokenizer's own, 0, 1, 2).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Non-special tags of the prompt/response format, each one token (the sampler stops on "</action>").
TAG_TOKENS = ("<action>", "</action>", "<think>", "</think>")

# ChatML without Qwen2.5's default system prompt ("You are Qwen, ..."): a conversation without a
# system message gets none. `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def train_tokenizer(corpus: Iterable[str], *, vocab_size: int = 1024,
                    phrase_tokens: Sequence[str] = (), model_max_length: int = 4096):
    """Train a byte-level BPE on ``corpus`` and wrap it with the chat template.

    Args:
      corpus: training texts (str); every byte value stays encodable whatever the corpus.
      vocab_size: size of the learned BPE part (256 byte symbols + merges + 3 special tokens);
        the phrase and tag tokens come on top, so ``len(tokenizer)`` is about
        ``vocab_size + len(phrase_tokens) + 4``.
      phrase_tokens: exact strings (e.g. ``"oak planks"``) to add as single non-special tokens;
        matched leftmost-longest anywhere in the text, never normalised.
      model_max_length: recorded in the tokenizer config.

    Returns:
      ``transformers.PreTrainedTokenizerFast`` with ``eos_token = "<|im_end|>"``,
      ``pad_token = "<|endoftext|>"``, ``bos_token = None`` and ``chat_template`` set.

    Raises:
      ValueError: if ``vocab_size`` < 300 (the 256 byte symbols plus room for merges) or a phrase
        token is empty or repeated.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte symbols + merges), got {vocab_size}")
    phrases = list(phrase_tokens)
    if any(not p for p in phrases):
        raise ValueError("phrase_tokens must be non-empty strings")
    if len(set(phrases)) != len(phrases):
        raise ValueError("phrase_tokens must be distinct")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in TAG_TOKENS])
    tok.add_tokens([AddedToken(p, normalized=False, single_word=False) for p in phrases])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_actor_config(vocab_size: int, **overrides) -> dict:
    """The embedded default actor's Hugging Face ``config.json`` dict (Qwen2 architecture).

    hidden 256, 4 layers, 4 query heads and 2 KV heads of dim 64, SiLU MLP 768, tied embeddings,
    RoPE theta 10,000, RMSNorm eps 1e-6; about 3.7M parameters with a 2k vocabulary. Override any
    field by keyword (HF names, e.g. ``num_hidden_layers=3``).

    Raises:
      ValueError: if ``vocab_size`` < 1 or ``hidden_size`` is not divisible by the head count.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    cfg = dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=int(vocab_size),
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=768, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False,
        attention_dropout=0.0, initializer_range=0.02, bos_token_id=None, eos_token_id=2,
        pad_token_id=0, torch_dtype="float32")
    cfg.update(overrides)
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError(f"hidden_size {cfg['hidden_size']} must be divisible by "
                         f"num_attention_heads {cfg['num_attention_heads']}")
    return cfg


def build_game_tokenizer(config, path: str, num_tasks: int = 64):
    """Train a small byte-level BPE on the game's own text and save it as an HF tokenizer folder.

    For a run config without a tokenizer (random tiny init): the corpus is the prompts (the config's
    template and options) and expert actions of ``num_tasks`` oracle episodes of ``config.env``, so
    the vocabulary fits the game. Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``,
    ``<|im_end|>`` (EOS of a response); the Qwen2.5 chat template is added by ``load_tokenizer``.
    Deterministic for a config. Returns the loaded tokenizer.
    """
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import environments
    from bipace_jax.config import resolve_template
    from bipace_jax.models import load_tokenizer
    from environments.prompts import build_prompt

    env = environments.make(config.env.name, max_steps=config.env.max_steps)
    template = resolve_template(config.rollout.template)
    texts = []
    for i in range(num_tasks):
        task = (i * 7919) % env.num_tasks
        obs = env.reset(task, i)
        history = []
        for step in range(config.env.max_steps):
            texts.append(build_prompt(config.env.name, obs, history, step,
                                      history_length=min(config.rollout.history_length, len(history)),
                                      template=template, show_inventory=config.rollout.show_inventory))
            action = env.oracle_action()
            if action is None:
                break
            texts.append(f"<think>I will {action}.</think><action>{action}</action>")
            new_obs, _, done, _ = env.step(action)
            history.append((obs.text, action))
            obs = new_obs
            if done:
                break
    texts.append("You are a helpful assistant. system user assistant")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.model.vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   bos_token=None, unk_token=None)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return load_tokenizer(path)
