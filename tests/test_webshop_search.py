"""WebShop's analyzer against real Lucene: the terms pyserini 0.17.0 (Anserini 0.14.3) recorded.

`tests/fixtures/lucene_analyzer_tokens.json` was written by `tests/fixtures/record_lucene_analyzer.py`
in a scratch virtualenv with Java; these tests need neither.
"""

import json
import os
import random

import numpy as np
import pytest

from environments import webshop_data as data
from environments import webshop_search as search

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lucene_analyzer_tokens.json")


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def analyzer():
    return search.Analyzer()


def test_fixture_is_the_recorded_lucene_run(recorded):
    prov = recorded["provenance"]
    assert (prov["pyserini"], prov["anserini_jar"]) == ("0.17.0", ["anserini-0.14.3-fatjar.jar"])
    assert len(recorded["cases"]) == 1370


def test_analyzer_gives_lucenes_terms_on_every_recorded_string(recorded, analyzer):
    wrong = [
        (c["text"], analyzer(c["text"]), c["tokens"]) for c in recorded["cases"] if analyzer(c["text"]) != c["tokens"]
    ]
    assert not wrong, wrong[:5]


@pytest.mark.parametrize(
    "text,terms",
    [
        # Lucene's Porter code (Martin Porter's reference), not the 1980 paper's ("assembli possibli").
        ("assembly possibly technology", ["assembl", "possibl", "technolog"]),
        ("5 ★ rating ☆", ["5", "★", "rate"]),  # U+2605 is pictographic, U+2606 is not
        ("I ❤️ NY 👍🏽 🇺🇸 #️⃣ 🇺", ["i", "❤️", "ny", "👍🏽", "🇺🇸", "#️⃣"]),  # modifiers, flags, keycaps
        ("Women's James' O'Reilly’s don't", ["women", "jame", "o'reilli", "don't"]),
        ('0.5mm 1,000 12" 2-pack USB-C 110-120V', ["0.5mm", "1,000", "12", "2", "pack", "usb", "c", "110", "120v"]),
        ("https://www.example.com a@b.co ___ a__b", ["http", "www.example.com", "b.co", "a__b"]),
        ("日本語 テキストabc ΣΟΦΟΣ İstanbul", ["日", "本", "語", "テキスト", "abc", "σοφοσ", "istanbul"]),
        ("the THE it IT us", ["us"]),  # stop words after lower case; words of two letters not stemmed
    ],
)
def test_hand_checked_cases(analyzer, text, terms):
    assert analyzer(text) == terms


def test_ascii_fast_path_gives_the_state_machines_tokens():
    rng = random.Random(0)
    alphabet = "ab1_.:,;'- xY9\"#*"
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        assert search.standard_tokens(text) == search._scan_tokens(text), text


def test_long_tokens_are_cut_like_lucenes_max_token_length():
    assert [len(t) for t in search.standard_tokens("x" * 600)] == [255, 255, 90]
    assert [len(t) for t in search.standard_tokens("é" * 600)] == [255, 255, 90]  # the non-ASCII path


def test_stems_are_memoised_per_word(analyzer):
    analyzer("caresses caresses")
    assert analyzer._stems["caresses"] == "caress"


def test_rankings_equal_lucenes_on_the_sample(analyzer):
    # 425 queries (the attribute file's instructions, the sample's titles) over the sample's 10
    # documents, searched by Anserini's SimpleSearcher (tests/fixtures/record_lucene_rankings.py).
    # With PyStemmer's paper Porter and no symbol tokens, 12 of them ranked differently.
    with open(os.path.join(os.path.dirname(FIXTURE), "lucene_rankings.json"), encoding="utf-8") as f:
        recorded = json.load(f)
    products = data.load_catalogue(data.SAMPLE_DIR).products
    docs = [(p.asin, search.document_text(p.title, p.description, p.bullet_points, p.options)) for p in products]
    assert docs == [(d["id"], d["contents"]) for d in recorded["docs"]]  # the documents Lucene indexed
    index = search.SearchIndex(docs)
    assert len(recorded["cases"]) == 425
    for case in recorded["cases"]:
        hits = index.search(case["query"])
        assert [index.ids[i] for i in hits] == [asin for asin, _ in case["hits"]], case["query"]
        scores = index.scores(case["query"])[hits]
        np.testing.assert_allclose(scores, [s for _, s in case["hits"]], rtol=1e-5, atol=1e-4)
