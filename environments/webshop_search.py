"""WebShop's product search without Java: Lucene's BM25 over the text WebShop indexes.

WebShop searches a pyserini (Lucene) index of one document per product whose ``contents`` is the
lower-cased ``title + " " + description + " " + first bullet point + " " + option text`` (option
text: ``"name: v1, v2"`` per group, groups joined by ``", and "``). Here:

* Analyzer (Anserini's ``DefaultEnglishAnalyzer`` as pyserini 0.17 runs it): Lucene's
  StandardTokenizer rules (``standard_tokens``: UAX #29 words, so "3.1", "1,000", "don't", "a.b",
  "snake_case" stay whole; each Han or Hiragana character alone; emoji and other pictographic
  symbols such as "★", "©", "♥" kept as tokens; other symbols and punctuation dropped; a token over
  255 characters cut into pieces), the English possessive "'s" dropped, lower case, Lucene's 33
  English stop words removed, and Lucene's ``PorterStemmer`` (Martin Porter's reference
  implementation, with its departures from the 1980 paper: "assembly possibly technology" ->
  "assembl possibl technolog") as NLTK's ``PorterStemmer(mode="MARTIN_EXTENSIONS")``, memoised.
  ``tests/fixtures/lucene_analyzer_tokens.json`` holds the terms real Lucene (pyserini 0.17.0,
  Anserini 0.14.3) gives for 1,370 strings (stemming departures, symbols, emoji, possessives, numbers
  with units, hyphens, URLs, e-mail addresses, scripts, every field of the sample's products and the
  1,000-product attribute file's instructions); this analyzer gives the same terms on every one,
  and ``SearchIndex`` ranks like Anserini's searcher on all 425 queries of
  ``tests/fixtures/lucene_rankings.json`` (with the paper's Porter and no symbol tokens, 12 differed).
* Scoring (Lucene 8 BM25, k1 0.9, b 0.4): per query term ``idf * tf / (tf + k1 (1 - b + b dl /
  avgdl))``, ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, no (k1 + 1) factor; ``dl`` is the
  document length as Lucene stores it (one byte, ``lucene_length``), ``avgdl`` the exact mean; a
  term repeated in the query counts that many times. The index is ``bm25s``'s (its Lucene variant)
  with the stored lengths swapped in.
* Hits: the 50 best-scoring documents that contain a query term, then (Anserini's tie rule)
  scores rounded to 4 decimals, ties by asin.

Known differences from the Java engine (none in the recorded strings): the tokenizer's Unicode
word-break classes are the ``regex`` module's Unicode version (Lucene 8's are an older one's;
characters whose class changed in between may split differently), the 255-character cut counts Python characters (Java
counts UTF-16 units: only differs for a token of astral characters that long), and scores are float32
sums in a different order.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import numpy as np
import scipy.sparse


def _import_without_jax():
    """Import bm25s, NLTK's Porter stemmer and regex with JAX hidden: bm25s runs a JAX op at import
    when it can, which would claim the accelerator from an env worker (and is slow); its NumPy path
    is used."""
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "jax" or k.startswith("jax.")}
    sys.modules["jax"] = None
    try:
        import bm25s
        import regex
        from nltk.stem.porter import PorterStemmer
    finally:
        del sys.modules["jax"]
        sys.modules.update(saved)
    return bm25s, regex, PorterStemmer


try:  # the webshop extra; a clear error when the index is built without it
    bm25s, regex, PorterStemmer = _import_without_jax()
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    bm25s = regex = PorterStemmer = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

INSTALL_HINT = 'WebShop\'s search needs bm25s, nltk and regex: pip install "bipace_jax[webshop]"'
K1, B = 0.9, 0.4
TOP_K = 50
#: Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET.
STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there "
    "these they this to was will with".split()
)
#: StandardTokenizer's default maximum token length; a longer run is cut into pieces of this length.
MAX_TOKEN_LENGTH = 255
# Unicode's Extended_Pictographic property (emoji-data.txt; stable since emoji 11.0, the table
# Lucene 8 uses), as code point ranges: the characters StandardTokenizer keeps as emoji tokens.
# (The regex module's \p{Extended_Pictographic} lacks e.g. U+2605 BLACK STAR and U+2661.)
_PICTOGRAPHIC_RANGES = (
    (0x00A9, 0x00A9), (0x00AE, 0x00AE), (0x203C, 0x203C), (0x2049, 0x2049), (0x2122, 0x2122),
    (0x2139, 0x2139), (0x2194, 0x2199), (0x21A9, 0x21AA), (0x231A, 0x231B), (0x2328, 0x2328),
    (0x2388, 0x2388), (0x23CF, 0x23CF), (0x23E9, 0x23F3), (0x23F8, 0x23FA), (0x24C2, 0x24C2),
    (0x25AA, 0x25AB), (0x25B6, 0x25B6), (0x25C0, 0x25C0), (0x25FB, 0x25FE), (0x2600, 0x2605),
    (0x2607, 0x2612), (0x2614, 0x2685), (0x2690, 0x2705), (0x2708, 0x2712), (0x2714, 0x2714),
    (0x2716, 0x2716), (0x271D, 0x271D), (0x2721, 0x2721), (0x2728, 0x2728), (0x2733, 0x2734),
    (0x2744, 0x2744), (0x2747, 0x2747), (0x274C, 0x274C), (0x274E, 0x274E), (0x2753, 0x2755),
    (0x2757, 0x2757), (0x2763, 0x2767), (0x2795, 0x2797), (0x27A1, 0x27A1), (0x27B0, 0x27B0),
    (0x27BF, 0x27BF), (0x2934, 0x2935), (0x2B05, 0x2B07), (0x2B1B, 0x2B1C), (0x2B50, 0x2B50),
    (0x2B55, 0x2B55), (0x3030, 0x3030), (0x303D, 0x303D), (0x3297, 0x3297), (0x3299, 0x3299),
    (0x1F000, 0x1F0FF), (0x1F10D, 0x1F10F), (0x1F12F, 0x1F12F), (0x1F16C, 0x1F171), (0x1F17E, 0x1F17F),
    (0x1F18E, 0x1F18E), (0x1F191, 0x1F19A), (0x1F1AD, 0x1F1E5), (0x1F201, 0x1F20F), (0x1F21A, 0x1F21A),
    (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F23C, 0x1F23F), (0x1F249, 0x1F3FA), (0x1F400, 0x1F53D),
    (0x1F546, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F774, 0x1F77F), (0x1F7D5, 0x1F7FF), (0x1F80C, 0x1F80F),
    (0x1F848, 0x1F84F), (0x1F85A, 0x1F85F), (0x1F888, 0x1F88F), (0x1F8AE, 0x1F8FF), (0x1F90C, 0x1F93A),
    (0x1F93C, 0x1F945), (0x1F947, 0x1FAFF), (0x1FC00, 0x1FFFD),
)  # fmt: skip
_KEYCAP_BASES = frozenset("#*0123456789")
_VS16, _KEYCAP = "\ufe0f", "\u20e3"
_POSSESSIVE_QUOTES = frozenset("'\u2019\uff07")
# Word-break classes (UAX #29) of the tokenizer's state machine.
_LETTER, _HEBREW, _NUMERIC, _KATAKANA, _EXTEND_NUM_LET = "L", "H", "N", "K", "E"
_MID_LETTER, _MID_NUM, _MID_NUM_LET, _SINGLE_QUOTE, _DOUBLE_QUOTE = "ML", "MN", "MNL", "SQ", "DQ"
_EXTEND, _REGIONAL, _IDEOGRAPH, _COMPLEX, _PICTOGRAPHIC, _OTHER = "X", "RI", "I", "SA", "P", "O"
_WORD = frozenset((_LETTER, _HEBREW, _NUMERIC, _KATAKANA, _EXTEND_NUM_LET))
_AH = frozenset((_LETTER, _HEBREW))
_PROPERTIES = (
    (_EXTEND, r"[\p{Word_Break=Extend}\p{Word_Break=Format}\p{Word_Break=ZWJ}]"),
    (_IDEOGRAPH, r"[\p{Script=Han}\p{Script=Hiragana}]"),
    (_COMPLEX, r"\p{Line_Break=Complex_Context}"),
    (_HEBREW, r"\p{Word_Break=Hebrew_Letter}"),
    (_LETTER, r"\p{Word_Break=ALetter}"),
    (_NUMERIC, r"\p{Word_Break=Numeric}"),
    (_KATAKANA, r"\p{Word_Break=Katakana}"),
    (_EXTEND_NUM_LET, r"\p{Word_Break=ExtendNumLet}"),
    (_MID_LETTER, r"\p{Word_Break=MidLetter}"),
    (_MID_NUM, r"\p{Word_Break=MidNum}"),
    (_MID_NUM_LET, r"\p{Word_Break=MidNumLet}"),
    (_SINGLE_QUOTE, r"\p{Word_Break=Single_Quote}"),
    (_DOUBLE_QUOTE, r"\p{Word_Break=Double_Quote}"),
    (_REGIONAL, r"\p{Word_Break=Regional_Indicator}"),
)
_COMPILED: list | None = None
_CLASS: dict[str, str] = {}


# The same rules on ASCII text (no Extend, pictographic, ideographic or keycap characters there):
# runs of [A-Za-z0-9_] joined by one MidLetter/MidNumLet/Single_Quote between letters or one
# MidNum/MidNumLet/Single_Quote between digits.
_ASCII_TOKEN = re.compile(
    r"[A-Za-z0-9_]+(?:(?:(?<=[A-Za-z])[.:'](?=[A-Za-z])|(?<=[0-9])[.,;'](?=[0-9]))[A-Za-z0-9_]+)*"
)


def _char_class(ch: str) -> str:
    """The tokenizer class of one character (the first matching property of `_PROPERTIES`, else
    pictographic or other), memoised."""
    c = _CLASS.get(ch)
    if c is None:
        global _COMPILED
        if _COMPILED is None:
            _COMPILED = [(name, regex.compile(pattern)) for name, pattern in _PROPERTIES]
        c = next((n for n, p in _COMPILED if p.match(ch)), _OTHER)
        if c == _OTHER and any(lo <= ord(ch) <= hi for lo, hi in _PICTOGRAPHIC_RANGES):
            c = _PICTOGRAPHIC
        _CLASS[ch] = c
    return c


def _joins(prev: str, nxt: str) -> bool:
    """No word break between two word characters (UAX #29 WB5, WB8-WB10, WB13, WB13a, WB13b)."""
    if nxt == _EXTEND_NUM_LET or prev == _EXTEND_NUM_LET:
        return True
    if prev == _KATAKANA or nxt == _KATAKANA:
        return prev == nxt
    return True  # letters and digits in any order


def _skip_extend(text: str, j: int) -> int:
    """Index after the Extend/Format/ZWJ characters at `j` (WB4: they belong to the character before)."""
    while j < len(text) and _char_class(text[j]) == _EXTEND:
        j += 1
    return j


def standard_tokens(text: str) -> list[str]:
    """Lucene StandardTokenizer's tokens of `text` (UAX #29 word boundaries, the token kinds it keeps).

    Kept: words of letters/digits/connector punctuation ("3.1", "1,000", "don't", "a.b", "snake_case";
    a run of only "_" is dropped), each Han or Hiragana character alone, runs of Thai/Lao/Khmer/
    Myanmar text, and emoji: a pictographic character with its modifiers and ZWJ sequence, a keycap
    (digit, "#" or "*" with U+20E3) or a pair of regional indicators (a flag). Everything else
    (punctuation, other symbols, white space) separates tokens. A token longer than
    `MAX_TOKEN_LENGTH` characters is cut into pieces of that length.

    Raises:
      ImportError: without the `webshop` extra (`INSTALL_HINT`).
    """
    if _IMPORT_ERROR is not None:
        raise ImportError(f"{INSTALL_HINT} ({_IMPORT_ERROR})")
    if text.isascii():  # the fast path (most product text): one regex, same tokens
        return [
            t[k : k + MAX_TOKEN_LENGTH]
            for t in _ASCII_TOKEN.findall(text)
            if t.strip("_")
            for k in range(0, len(t), MAX_TOKEN_LENGTH)
        ]
    return _scan_tokens(text)


def _scan_tokens(text: str) -> list[str]:
    """`standard_tokens` by the per-character state machine (any text)."""
    out: list[str] = []
    n, i = len(text), 0
    while i < n:
        ch = text[i]
        c = _char_class(ch)
        j = i + 1
        if ch in _KEYCAP_BASES and _keycap_end(text, j) is not None:
            j = _keycap_end(text, j)
        elif c in _WORD:
            prev, has_word = c, c != _EXTEND_NUM_LET
            j = _skip_extend(text, j)
            while j < n:
                d = _char_class(text[j])
                if d in _WORD and _joins(prev, d):
                    prev, has_word = d, has_word or d != _EXTEND_NUM_LET
                    j = _skip_extend(text, j + 1)
                    continue
                k = _skip_extend(text, j + 1)
                e = _char_class(text[k]) if k < n else _OTHER
                if (
                    (prev in _AH and d in (_MID_LETTER, _MID_NUM_LET, _SINGLE_QUOTE) and e in _AH)
                    or (prev == _NUMERIC and d in (_MID_NUM, _MID_NUM_LET, _SINGLE_QUOTE) and e == _NUMERIC)
                    or (prev == _HEBREW and d == _DOUBLE_QUOTE and e == _HEBREW)
                ):
                    prev = e
                    j = _skip_extend(text, k + 1)
                    continue
                if prev == _HEBREW and d == _SINGLE_QUOTE:  # WB7a: a Hebrew letter keeps its geresh
                    j = k
                break
            if not has_word:
                i = j
                continue
        elif c == _IDEOGRAPH:
            j = _skip_extend(text, j)
        elif c == _COMPLEX:
            while j < n and _char_class(text[j]) in (_COMPLEX, _EXTEND):
                j += 1
        elif c == _REGIONAL:
            k = _skip_extend(text, j)
            if k < n and _char_class(text[k]) == _REGIONAL:
                j = _skip_extend(text, k + 1)
            else:
                i = k
                continue
        elif c == _PICTOGRAPHIC:
            j = _skip_extend(text, j)
            # A ZWJ (absorbed above) followed by another pictograph continues the sequence.
            while j < n and text[j - 1] == "\u200d" and _char_class(text[j]) == _PICTOGRAPHIC:
                j = _skip_extend(text, j + 1)
        else:
            i = j
            continue
        token = text[i:j]
        out.extend(token[k : k + MAX_TOKEN_LENGTH] for k in range(0, len(token), MAX_TOKEN_LENGTH))
        i = j
    return out


def _keycap_end(text: str, j: int) -> int | None:
    """End of a keycap sequence whose base ends at `j` (optional U+FE0F, then U+20E3), else None."""
    if j < len(text) and text[j] == _VS16:
        j += 1
    if j < len(text) and text[j] == _KEYCAP:
        return _skip_extend(text, j + 1)
    return None


def _lower(token: str) -> str:
    """Lower case per character, as Java's Character.toLowerCase (no final-sigma rule; "İ" -> "i")."""
    if token.isascii():
        return token.lower()
    return "".join(ch.lower()[:1] for ch in token)  # only "İ" lower-cases to two characters in Python


class Analyzer:
    """Text -> index terms: Anserini's DefaultEnglishAnalyzer as pyserini 0.17 runs it.

    StandardTokenizer (`standard_tokens`), EnglishPossessiveFilter (a trailing "'s", "’s" or "＇s"
    removed, any case), LowerCaseFilter, Lucene's 33 English stop words (`STOP_WORDS`), then Lucene's
    PorterStemmer, which is Martin Porter's reference implementation: NLTK's
    `PorterStemmer(mode="MARTIN_EXTENSIONS")` (words of one or two characters kept), memoised per word.

    Raises:
      ImportError: without the `webshop` extra (`INSTALL_HINT`).
    """

    def __init__(self):
        if _IMPORT_ERROR is not None:
            raise ImportError(f"{INSTALL_HINT} ({_IMPORT_ERROR})")
        self._porter = PorterStemmer(mode=PorterStemmer.MARTIN_EXTENSIONS)
        self._stems: dict[str, str] = {}

    def stem(self, word: str) -> str:
        """Lucene's Porter stem of a lower-cased word (memoised)."""
        s = self._stems.get(word)
        if s is None:
            s = self._stems[word] = self._porter.stem(word, to_lowercase=False)
        return s

    def __call__(self, text: str) -> list[str]:
        terms = []
        for tok in standard_tokens(text):
            if len(tok) >= 2 and tok[-1] in "sS" and tok[-2] in _POSSESSIVE_QUOTES:
                tok = tok[:-2]
            tok = _lower(tok)
            if not tok or tok in STOP_WORDS:
                continue
            terms.append(self.stem(tok))
        return terms


def lucene_length(length: int | np.ndarray) -> np.ndarray:
    """A field length as Lucene 8's norm keeps it (SmallFloat byte4): exact below 24, then the
    excess over 24 rounded down to 4 significant bits (e.g. 300 -> 280)."""
    n = np.asarray(length, dtype=np.int64)
    excess = np.maximum(n - 24, 0)
    bits = np.floor(np.log2(np.maximum(excess, 1))).astype(np.int64) + 1
    shift = np.maximum(bits - 4, 0)
    return np.where(n < 24, n, 24 + ((excess >> shift) << shift))


class _LuceneBM25(bm25s.BM25 if bm25s is not None else object):
    """bm25s's Lucene-variant index, with document lengths as Lucene stores them."""

    def build_index_from_ids(self, unique_token_ids, corpus_token_ids, show_progress=True, leave_progress=False):
        n_docs, n_vocab = len(corpus_token_ids), len(unique_token_ids)
        self.nonoccurrence_array = None  # only BM25L / BM25+ add a score for absent terms
        lengths = np.array([len(d) for d in corpus_token_ids], dtype=np.float64)
        avgdl = max(lengths.sum() / max(n_docs, 1), 1e-9)
        rows, cols, tfs = [], [], []
        for d, ids in enumerate(corpus_token_ids):
            terms, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
            rows.append(np.full(len(terms), d, dtype=np.int64))
            cols.append(terms)
            tfs.append(counts)
        rows, cols = np.concatenate(rows or [np.zeros(0, np.int64)]), np.concatenate(cols or [np.zeros(0, np.int64)])
        tf = np.concatenate(tfs or [np.zeros(0, np.int64)]).astype(np.float64)
        df = np.bincount(cols, minlength=n_vocab).astype(np.float64)
        idf = np.log1p((n_docs - df + 0.5) / (df + 0.5))
        dl = lucene_length(lengths.astype(np.int64))[rows].astype(np.float64)
        score = idf[cols] * tf / (tf + self.k1 * (1 - self.b + self.b * dl / avgdl))
        m = scipy.sparse.csc_matrix((score, (rows, cols)), shape=(n_docs, n_vocab), dtype=np.float64)
        return {
            "data": m.data.astype(self.dtype),
            "indices": m.indices.astype(self.int_dtype),
            "indptr": m.indptr,
            "num_docs": n_docs,
        }


def document_text(title: str, description: str, bullet_points: Sequence[str], options) -> str:
    """The text WebShop indexes for a product (``options``: name -> values)."""
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in options.items())
    first_bullet = bullet_points[0] if bullet_points else ""
    return " ".join([title, description, first_bullet, option_text]).lower()


class SearchIndex:
    """BM25 search over documents ``(doc_id, text)``; ``search`` returns document positions.

    Raises ImportError naming the extra to install when bm25s, nltk or regex is missing.
    """

    def __init__(self, docs: Sequence[tuple[str, str]]):
        self.analyzer = Analyzer()
        self.ids = [d for d, _ in docs]
        vocab: dict[str, int] = {}
        corpus = [[vocab.setdefault(t, len(vocab)) for t in self.analyzer(text)] for _, text in docs]
        self._bm25 = _LuceneBM25(k1=K1, b=B, method="lucene")
        self._bm25.index((corpus, vocab), create_empty_token=False, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query`` (float32, 0 where no query term occurs)."""
        ids = self._bm25.get_tokens_ids(self.analyzer(query))
        return self._bm25.get_scores_from_ids(ids)

    def search(self, query: str, k: int = TOP_K) -> list[int]:
        """Positions of the best ``k`` documents for ``query`` (the module docstring's ranking)."""
        scores = self.scores(query)
        hits = np.flatnonzero(scores > 0)
        top = hits[np.lexsort((hits, -scores[hits]))][:k]  # Lucene's top k: score, then index order
        rounded = np.round(scores[top].astype(np.float64), 4)
        return [int(i) for _, _, i in sorted(zip(-rounded, [self.ids[i] for i in top], top))]
