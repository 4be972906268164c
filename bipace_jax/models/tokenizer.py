"""Tokenizer loading with the bundled Qwen2.5 chat template.

The tokenizer always comes from the user's checkpoint folder (`transformers.AutoTokenizer`, local
files only, no remote code). When the folder has no chat template, the project's Qwen2.5 template
(`bipace_jax/data/qwen2_5_chat_template.jinja`: ChatML turns `<|im_start|>{role}\\n{content}<|im_end|>\\n`
with Qwen's default system prompt inserted when the conversation has none) is attached.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from typing import Any

__all__ = ["QWEN2_5_CHAT_TEMPLATE_FILE", "qwen2_5_chat_template", "load_tokenizer"]

QWEN2_5_CHAT_TEMPLATE_FILE = "qwen2_5_chat_template.jinja"


def qwen2_5_chat_template() -> str:
    """The bundled Qwen2.5 chat template (Jinja source text)."""
    return (
        importlib.resources.files("bipace_jax").joinpath("data", QWEN2_5_CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    )


_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_backend(path: str) -> bool:
    """True when the folder's tokenizer_config.json names the generic `tokenizers` backend."""
    cfg = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or not os.path.isfile(cfg):
        return False
    with open(cfg, encoding="utf-8") as f:
        return json.load(f).get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES


def load_tokenizer(path: str | os.PathLike) -> Any:
    """`transformers.AutoTokenizer` from a local checkpoint folder, with a chat template.

    Args:
      path: folder with tokenizer files (tokenizer.json / tokenizer_config.json, ...).

    Returns:
      The folder's own `tokenizer.json` as-is when tokenizer_config.json names the generic backend
      (`TokenizersBackend`/`PreTrainedTokenizerFast`), else `AutoTokenizer`'s choice (e.g.
      `Qwen2Tokenizer`); with the folder's chat template, or the bundled Qwen2.5 one.

    Raises:
      FileNotFoundError: `path` is not a folder.
      ValueError: the folder holds no loadable tokenizer (the transformers error is chained).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_tokenizer: {path} is not a folder")
    try:
        if _generic_backend(path):
            # AutoTokenizer would follow config.json's `model_type: qwen2` and swap in Qwen2's own
            # pre-tokenizer, silently changing a project-trained BPE's token ids.
            tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"load_tokenizer: no loadable tokenizer in {path}: {e}") from e
    if not getattr(tok, "chat_template", None):
        tok.chat_template = qwen2_5_chat_template()
    return tok
