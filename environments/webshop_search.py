"""WebShop's product search without Java: Lucene's BM25 over the text WebShop indexes.

WebShop searches a pyserini (Lucene) index of one document per product whose ``contents`` is the
lower-cased ``title + " " + description + " " + first bullet point + " " + option text`` (option
text: ``"name: v1, v2"`` per group, groups joined by ``", and "``). Here:

* Analyzer (Anserini's default English analyzer): Unicode word-break tokens (letters and digits;
  "3.1", "1,000", "don't", "a.b" stay whole; ideographs one per token), the English possessive
  "'s" dropped, lower case, Lucene's 33 English stop words removed, Porter stemming (PyStemmer's
  ``porter``, the original algorithm; like Lucene, words of one or two characters are kept as is).
* Scoring (Lucene 8 BM25, k1 0.9, b 0.4): per query term ``idf * tf / (tf + k1 (1 - b + b dl /
  avgdl))``, ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, no (k1 + 1) factor; ``dl`` is the
  document length as Lucene stores it (one byte, ``lucene_length``), ``avgdl`` the exact mean; a
  term repeated in the query counts that many times. The index is ``bm25s``'s (its Lucene variant)
  with the stored lengths swapped in.
* Hits: the 50 best-scoring documents that contain a query term, then (Anserini's tie rule)
  scores rounded to 4 decimals, ties by asin.

Known differences from the Java engine: Lucene's Porter code has two departures from the
published algorithm that PyStemmer's may not share ("-bli" -> "-ble", "-logi" -> "-log"); tokens
over 255 characters are not split; scores are float32 sums in a different order.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import numpy as np
import scipy.sparse


def _import_without_jax():
    """Import bm25s and PyStemmer with JAX hidden: bm25s runs a JAX op at import when it can,
    which would claim the accelerator from an env worker (and is slow); its NumPy path is used."""
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "jax" or k.startswith("jax.")}
    sys.modules["jax"] = None
    try:
        import bm25s
        import Stemmer
    finally:
        del sys.modules["jax"]
        sys.modules.update(saved)
    return bm25s, Stemmer


try:  # the webshop extra; a clear error when the index is built without it
    bm25s, Stemmer = _import_without_jax()
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    bm25s = Stemmer = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

INSTALL_HINT = 'WebShop\'s search needs bm25s and PyStemmer: pip install "bipace_jax[webshop]"'
K1, B = 0.9, 0.4
TOP_K = 50
#: Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET.
STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there "
    "these they this to was will with".split()
)
# Unicode word-break (UAX #29) on the characters product text uses: a run of letters/digits/"_"
# continues across one MidLetter (":" "·") or MidNumLet ("." "'" "’") between letters, or one
# MidNum ("," ";") or MidNumLet between digits.
_LETTER = r"[^\W\d_]"
_TOKEN = re.compile(
    rf"\w+(?:(?<={_LETTER})[:.'\u00b7\u2018\u2019\u2027](?={_LETTER})\w+|(?<=\d)[,;.'\u2018\u2019](?=\d)\w+)*"
)
_IDEOGRAPH = re.compile(r"([\u3040-\u309f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff])")
_POSSESSIVE = re.compile(r"['\u2019\uff07][sS]$")


def _stemmer():
    if _IMPORT_ERROR is not None:
        raise ImportError(f"{INSTALL_HINT} ({_IMPORT_ERROR})")
    return Stemmer.Stemmer("porter")


class Analyzer:
    """Text -> index terms (tokenise, drop possessives, lower-case, drop stop words, stem)."""

    def __init__(self):
        self._stem = _stemmer().stemWord

    def __call__(self, text: str) -> list[str]:
        terms = []
        for m in _TOKEN.finditer(_IDEOGRAPH.sub(r" \1 ", text)):
            tok = _POSSESSIVE.sub("", m.group()).lower()
            if not tok.strip("_") or tok in STOP_WORDS:
                continue
            terms.append(self._stem(tok) if len(tok) > 2 else tok)
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

    Raises ImportError naming the extra to install when bm25s or PyStemmer is missing.
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
