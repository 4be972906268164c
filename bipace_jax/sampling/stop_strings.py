"""Stop strings on the device: byte texts of tokens and a per-token automaton table (host side, once
per tokenizer), advanced by one table lookup per drawn token.

Stop strings are matched on bytes of the decoded text: for each stop string a Knuth-Morris-Pratt
automaton is run over the byte text of every token id once, on the host, giving a table
``next_state[S, Q, V]`` (the matched-prefix length after a token, ``len(stop)`` when the stop text
completes anywhere inside that token). The decode loop carries one state per row and stop string
(``advance``), so a stop text spread over several tokens, or merged with other characters into one
token, is found exactly: the response ends with the token whose text completes the stop text.

Shape letters: B rows, V vocabulary, S stop strings, Q stop-string states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["advance", "fit_to_vocab", "stop_string_table", "token_byte_texts", "truncate_at_stop"]


def _byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2 / Qwen): printable unicode char -> byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in printable]  # shifted to chr(256 + k), in byte order
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def token_byte_texts(tokenizer: Any) -> list[bytes]:
    """The text of every token id as UTF-8 bytes, as the tokenizer's decoder would emit it.

    Byte-level BPE tokenizers (Qwen2, GPT-2): the token's bytes exactly, so concatenating them gives the
    decoded text's bytes. Special tokens give ``b""`` (``decode(..., skip_special_tokens=True)``
    drops them). Other tokenizers: ``tokenizer.decode([id])`` encoded as UTF-8 (an approximation where
    the decoder adds or removes spaces between tokens).

    Returns:
      list of ``len(tokenizer)`` byte strings, indexed by token id.
    """
    n = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
    added = dict(getattr(tokenizer, "added_tokens_decoder", {}))
    out: list[bytes] = []
    if byte_level:
        inv = _byte_decoder()
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                out.append(b"")
            elif i in added:
                out.append(b"" if getattr(added[i], "special", False) else str(added[i].content).encode("utf-8"))
            else:
                try:
                    out.append(bytes(inv[c] for c in piece))
                except KeyError:  # not in the byte alphabet: take it as literal text
                    out.append(piece.encode("utf-8"))
    else:
        for i in range(n):
            out.append(b"" if i in special else tokenizer.decode([i], skip_special_tokens=True).encode("utf-8"))
    return out


def _kmp_dfa(pattern: bytes) -> np.ndarray:
    """int32[L + 1, 256]: the KMP automaton of ``pattern`` (state = length of the matched prefix)."""
    length = len(pattern)
    dfa = np.zeros((length + 1, 256), np.int32)
    dfa[0, pattern[0]] = 1
    restart = 0
    for q in range(1, length + 1):
        dfa[q] = dfa[restart]
        if q < length:
            dfa[q, pattern[q]] = q + 1
            restart = dfa[restart, pattern[q]]
    return dfa


def stop_string_table(token_texts: Sequence[bytes], stop_strings: Sequence[str]) -> np.ndarray:
    """The stop-string automaton over whole tokens.

    ``table[s, q, v]`` is the number of bytes of stop string ``s`` matched (as a suffix of the text so
    far) after the text of token ``v`` is appended to a text whose matched prefix length was ``q``;
    it equals ``len(stop_strings[s])`` (in UTF-8 bytes) when the stop text completes anywhere inside
    token ``v``'s text, which ends the response. Rows ``q >= len(stop_strings[s])`` are unused.

    Args:
      token_texts: V byte strings (``token_byte_texts``).
      stop_strings: S non-empty strings.

    Returns:
      int32[S, Q, V] with Q = the longest stop string's length in bytes (Q = 1, S = 0 when none).
    """
    patterns = [s.encode("utf-8") for s in stop_strings]
    v = len(token_texts)
    q_max = max([len(p) for p in patterns], default=1)
    table = np.zeros((len(patterns), q_max, v), np.int32)
    if not patterns:
        return table
    lens = np.array([len(t) for t in token_texts], np.int64)
    width = int(lens.max(initial=0))
    mat = np.zeros((v, max(width, 1)), np.uint8)
    for i, t in enumerate(token_texts):
        if t:
            mat[i, : len(t)] = np.frombuffer(t, np.uint8)
    for s, pat in enumerate(patterns):
        dfa = _kmp_dfa(pat)
        length = len(pat)
        for q in range(length):
            state = np.full(v, q, np.int32)
            for j in range(width):
                live = (j < lens) & (state < length)
                if not live.any():
                    break
                state = np.where(live, dfa[state, mat[:, j]], state)
            table[s, q] = state
    return table


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` cut right after the earliest-ending occurrence of any stop string (unchanged if none).

    The sampler stops at the token that completes a stop text; that token may carry characters after
    it (tokenizers merge characters), which this removes from the decoded text.
    """
    ends = [text.find(stop) + len(stop) for stop in stop_strings if stop in text]
    return text[: min(ends)] if ends else text


def fit_to_vocab(table: np.ndarray, vocab: int) -> np.ndarray:
    """The [S, Q, V_tok] table fitted to the model's vocabulary V: ids the tokenizer lacks have no text
    (the state stays); ids beyond V are dropped. Returns int32[S, Q, V]."""
    s, q, v_tok = table.shape
    if v_tok >= vocab:
        return table[:, :, :vocab]
    keep_state = np.broadcast_to(np.arange(q, dtype=np.int32)[None, :, None], (s, q, vocab - v_tok))
    return np.concatenate([table, keep_state], axis=-1)


def advance(table: jax.Array, stop_lens: jax.Array, state: jax.Array, token: jax.Array):
    """One token through every row's stop-string automata.

    Args:
      table: int32[S, Q, V] (``stop_string_table`` fitted to V); stop_lens: int32[S] each stop
        string's length in UTF-8 bytes.
      state: int32[B, S] the matched-prefix lengths so far; token: int32[B] the token drawn.

    Returns:
      (int32[B, S] the new states, bool[B] whether a stop text completed inside ``token``'s text).
    """
    if table.shape[0] == 0:
        return state, jnp.zeros(token.shape, bool)
    s_idx = jnp.arange(table.shape[0])[None, :]
    new = table[s_idx, jnp.minimum(state, table.shape[1] - 1), token[:, None]]
    hit = jnp.any(new >= stop_lens[None, :], axis=-1)
    return new, hit
