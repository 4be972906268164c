"""Tokenizer loading with the bundled Qwen2.5 chat template.

The tokenizer always comes from the user's checkpoint folder (`transformers.AutoTokenizer`, local
files only, no remote code). When the folder has no chat template, the project's Qwen2.5 template
(`bipace_jax/data/qwen2_5_chat_template.jinja`: ChatML turns `<|im_start|>{role}\\n{content}<|im_end|>\\n`
with Qwen's default system prompt inserted when the conversation has none) is attached.
"""

from __future__ import annotations

import importlib.resources
import os
from typing import Any

__all__ = ["QWEN2_5_CHAT_TEMPLATE_FILE", "qwen2_5_chat_template", "load_tokenizer"]

QWEN2_5_CHAT_TEMPLATE_FILE = "qwen2_5_chat_template.jinja"


def qwen2_5_chat_template() -> str:
    """The bundled Qwen2.5 chat template (Jinja source text)."""
    return importlib.resources.files("bipace_jax").joinpath("data", QWEN2_5_CHAT_TEMPLATE_FILE).read_text(
        encoding="utf-8")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """`transformers.AutoTokenizer` from a local checkpoint folder, with a chat template.

    Args:
      path: folder with tokenizer files (tokenizer.json / tokenizer_config.json, ...).

    Returns:
      The tokenizer; `chat_template` is the folder's own, or the bundled Qwen2.5 template when the
      folder has none.

    Raises:
      FileNotFoundError: `path` is not a folder.
      ValueError: the folder holds no loadable tokenizer (the transformers error is chained).
    """
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_tokenizer: {path} is not a folder")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"load_tokenizer: no loadable tokenizer in {path}: {e}") from e
    if not getattr(tok, "chat_template", None):
        tok.chat_template = qwen2_5_chat_template()
    return tok
