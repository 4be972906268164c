"""Engine tests on small fake causal models with the actor's cache contract (prefill/decode_step)
and a small byte-level BPE tokenizer trained here. The real Qwen2 actor is tested in
tests/test_sampling_actor.py."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bipace_jax.sampling import (
    Engine,
    SampleOutput,
    SamplerConfig,
    filter_logits,
    first_argmax,
    sample_tokens,
    stop_string_table,
    token_byte_texts,
    truncate_at_stop,
)

CORPUS = [
    "<think>I need planks first</think><action>craft 4 oak planks using 1 oak log</action>\n",
    "Inventory: [oak log] (1) Got 1 oak log. Crafted 4 minecraft:oak_planks </action>.</action>\n",
    "<action>get 2 iron ingot</action> <action>inventory</action> </act ion> ação café 你好 a/b <a>",
]


@functools.cache
def small_tokenizer(vocab_size: int = 400):
    """A byte-level BPE (the Qwen2 tokenizer family) trained on a few game lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


class FakeCache(NamedTuple):
    emb: jax.Array  # [B, S, D]
    slot_mask: jax.Array  # bool[B, S]
    lengths: jax.Array  # int32[B]
    index: jax.Array  # int32[]


class FakeConfig(NamedTuple):
    vocab_size: int


class FakeLM(nnx.Module):
    """A causal model with a KV-style cache: h_t = tanh(mean of real token embeddings so far + pos[t]).

    Same contract as Qwen2Actor: positions come from the mask, prefill returns last-real-token logits
    and an L2-normalised fingerprint, decode_step writes slot ``index`` at position ``lengths``."""

    def __init__(self, vocab: int = 64, dim: int = 16, max_pos: int = 512, *, seed: int = 0, scale: float = 3.0):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        self.config = FakeConfig(vocab)
        self.embed = nnx.Param(jax.random.normal(k1, (vocab, dim)))
        self.pos = nnx.Param(0.5 * jax.random.normal(k2, (max_pos, dim)))
        self.head = nnx.Param(scale * jax.random.normal(k3, (dim, vocab)) / math.sqrt(dim))

    def _out(self, summed, count, pos):
        h = jnp.tanh(summed / jnp.maximum(count, 1)[..., None] + self.pos[...][pos])
        return h @ self.head[...], h

    def __call__(self, input_ids, attention_mask):
        m = attention_mask.astype(jnp.float32)
        e = self.embed[...][input_ids] * m[..., None]
        cnt = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)
        logits, h = self._out(jnp.cumsum(e, axis=1), cnt, jnp.maximum(cnt - 1, 0))
        return logits

    def init_cache(self, batch_size, max_length):
        d = self.embed.shape[1]
        return FakeCache(
            jnp.zeros((batch_size, max_length, d)),
            jnp.zeros((batch_size, max_length), bool),
            jnp.zeros((batch_size,), jnp.int32),
            jnp.zeros((), jnp.int32),
        )

    def prefill(self, input_ids, attention_mask, cache):
        t = input_ids.shape[1]
        m = attention_mask.astype(bool)
        e = self.embed[...][input_ids] * m[..., None]
        lengths = m.sum(axis=1).astype(jnp.int32)
        cache = FakeCache(cache.emb.at[:, :t].set(e), cache.slot_mask.at[:, :t].set(m), lengths, jnp.int32(t))
        logits, h = self._out(e.sum(axis=1), lengths, jnp.maximum(lengths - 1, 0))
        fp = h / jnp.linalg.norm(h, axis=-1, keepdims=True)
        return _Out(logits, fp), cache

    def decode_step(self, token_ids, cache):
        e = self.embed[...][token_ids]
        emb = jax.lax.dynamic_update_slice_in_dim(cache.emb, e[:, None], cache.index, axis=1)
        sm = jax.lax.dynamic_update_slice_in_dim(cache.slot_mask, jnp.ones((e.shape[0], 1), bool), cache.index, axis=1)
        lengths = cache.lengths + 1
        cache = FakeCache(emb, sm, lengths, cache.index + 1)
        logits, _ = self._out((emb * sm[..., None]).sum(axis=1), lengths, lengths - 1)
        return logits, cache


class _Out(NamedTuple):
    logits: jax.Array
    fingerprint: jax.Array


class ScriptedLM(FakeLM):
    """Emits ``script[row, p]`` (as a +30 logit) as the token at absolute position p (p = real tokens so far)."""

    def __init__(self, script: np.ndarray, vocab: int):
        super().__init__(vocab=vocab, dim=4, max_pos=script.shape[1] + 1)
        self.script = nnx.Variable(jnp.asarray(script, jnp.int32))

    def _scripted(self, lengths):
        nxt = jnp.take_along_axis(self.script[...], lengths[:, None], axis=1)[:, 0]
        return 30.0 * jax.nn.one_hot(nxt, self.config.vocab_size)

    def prefill(self, input_ids, attention_mask, cache):
        out, cache = super().prefill(input_ids, attention_mask, cache)
        return _Out(self._scripted(cache.lengths), out.fingerprint), cache

    def decode_step(self, token_ids, cache):
        _, cache = super().decode_step(token_ids, cache)
        return self._scripted(cache.lengths), cache


def greedy_reference(model, prompt, max_new, eos_ids, width=64):
    """Step-by-step argmax over the model's full forward (no cache); one compiled shape (right padding)."""
    forward = nnx.jit(lambda m, i, k: m(i, k))
    seq = list(prompt)
    out = []
    for _ in range(max_new):
        ids = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        mask = jnp.asarray([[1] * len(seq) + [0] * (width - len(seq))], jnp.int32)
        tok = int(jnp.argmax(forward(model, ids, mask)[0, len(seq) - 1]))
        out.append(tok)
        seq.append(tok)
        if tok in eos_ids:
            break
    return out


# ------------------------------------------------------------------------------------------------


def test_token_byte_texts_concatenate_to_decoded_text():
    tok = small_tokenizer()
    texts = token_byte_texts(tok)
    assert len(texts) == len(tok)
    for line in CORPUS:
        ids = tok.encode(line)
        assert b"".join(texts[i] for i in ids).decode("utf-8") == tok.decode(ids)
    assert texts[tok.eos_token_id] == b"" and texts[tok.pad_token_id] == b""


def _first_stop_oracle(texts, seq, stops):
    """Index of the token after which the joined text first contains a stop string, else None."""
    acc = b""
    pats = [s.encode() for s in stops]
    for k, t in enumerate(seq):
        acc += texts[t]
        if any(p in acc for p in pats):
            return k
    return None


def test_stop_table_finds_stop_text_exactly_where_text_search_does():
    tok = small_tokenizer()
    texts = token_byte_texts(tok)
    stops = ["</action>", "ion>\n", "a"]
    table = stop_string_table(texts, stops)
    lens = np.array([len(s.encode()) for s in stops])
    assert table.shape == (3, 9, len(tok))
    # Tokens that spell pieces of the stop texts, so random sequences hit them often.
    pieces = sorted({i for s in CORPUS for i in tok.encode(s)})
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(600):
        n = int(rng.integers(1, 12))
        seq = list(rng.choice(pieces, size=n))
        state = np.zeros(3, np.int64)
        found = None
        for k, t in enumerate(seq):
            state = table[np.arange(3), np.minimum(state, table.shape[1] - 1), t]
            if (state >= lens).any():
                found = k
                break
        assert found == _first_stop_oracle(texts, seq, stops), (seq, found)
        hits += found is not None
    assert 100 < hits < 600  # both outcomes are exercised


def test_stop_table_handles_a_stop_text_spread_over_tokens_and_merged_with_other_text():
    tok = small_tokenizer()
    texts = token_byte_texts(tok)
    table = stop_string_table(texts, ["</action>"])
    seq = tok.encode("<action>craft 4 oak planks</action>.")  # "</", "action", ">" or merged variants
    assert len(seq) > 3
    state, cut = 0, None
    for k, t in enumerate(seq):
        state = table[0, state, t]
        if state == 9:
            cut = k
            break
    assert tok.decode(seq[: cut + 1]).endswith("</action>") or tok.decode(seq[: cut + 1]).endswith("</action>.")
    assert "</action>" not in tok.decode(seq[:cut])


def test_truncate_at_stop_cuts_after_earliest_stop_text():
    assert truncate_at_stop("a</action>\nb</action>", ["</action>"]) == "a</action>"
    assert truncate_at_stop("xyz", ["</action>"]) == "xyz"
    assert truncate_at_stop("ab END cd STOP", ["STOP", "END"]) == "ab END"


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (5, 1.0), (5, 0.6), (0, 0.3), (1, 1.0), (0, 1e-6)])
def test_filter_logits_keeps_the_same_tokens_as_hf_warpers(top_k, top_p):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 2
    ours = np.asarray(filter_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p))
    ref = torch.from_numpy(logits.copy())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref.numpy()))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], logits[np.isfinite(ours)])


@pytest.mark.slow
@pytest.mark.parametrize(
    "cpu", [True, False]
)  # the CPU's bisection loops; the accelerators' top_k + unrolled bisection
@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (7, 1.0), (0, 0.37), (0, 0.81), (6, 0.55), (1, 0.9)])
def test_filter_logits_matches_the_sorted_rule_with_ties_infinities_and_signed_zeros(top_k, top_p, cpu):
    rng = np.random.default_rng(top_k * 100 + int(top_p * 100))
    x = rng.integers(-4, 5, size=(48, 33)).astype(np.float32) * 0.5  # many ties
    x[0] = 0.0
    x[1, ::2] = -0.0
    x[2, :20] = -np.inf
    x[3, 5] = 1e30
    x[4] = rng.normal(size=33).astype(np.float32) * 30
    filt = jax.jit(functools.partial(filter_logits, top_k=top_k, top_p=top_p, cpu=cpu))
    got = np.isfinite(np.asarray(filt(jnp.asarray(x))))
    for row, keep in zip(x, got):
        # The rule with a sort (float64): keep the top-k (ties with the k-th too), then, over their
        # renormalised probabilities in descending order, every token whose predecessors' mass < top_p,
        # and every token tied with the last kept one.
        order = np.argsort(-row, kind="stable")
        vals = row[order].astype(np.float64)
        kth = vals[min(top_k, len(vals)) - 1] if top_k else -np.inf
        ref = row >= kth
        if top_p < 1.0:
            kept_vals = vals[vals >= kth]
            p = np.exp(kept_vals - kept_vals.max())
            p /= p.sum()
            n = max(1, int(np.sum(np.cumsum(p) - p < top_p)))
            ref &= row >= kept_vals[n - 1]
        np.testing.assert_array_equal(keep, ref, err_msg=str(row))


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (0, 0.3)])
def test_filter_logits_treats_plus_and_minus_zero_as_a_tie(top_k, top_p):
    for row in ([0.0, -0.0], [-0.0, 0.0]):
        got = filter_logits(jnp.asarray([row], jnp.float32), top_k=top_k, top_p=top_p)
        np.testing.assert_array_equal(np.isfinite(np.asarray(got)), [[True, True]])


def _filtered_probs_oracle(logits, temperature, top_k, top_p):
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    cand = order[:top_k] if top_k else order
    p = np.exp(x[cand] - x[cand].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[cand[(before < top_p) | (np.arange(len(cand)) == 0)]] = True
    q = np.where(keep, np.exp(x - x.max()), 0.0)
    return q / q.sum()


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.5, 0, 0.75), (1.0, 5, 0.9)])
def test_sampled_tokens_follow_the_filtered_distribution(temperature, top_k, top_p):
    from scipy import stats

    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 20000
    keys = jax.random.split(jax.random.key(1234), n)
    toks, logp = jax.jit(functools.partial(sample_tokens, greedy=False, top_k=top_k, top_p=top_p))(
        jnp.broadcast_to(jnp.asarray(logits), (n, 8)), keys, 3, temperature
    )
    toks = np.asarray(toks)
    probs = _filtered_probs_oracle(logits.astype(np.float64), temperature, top_k, top_p)
    counts = np.bincount(toks, minlength=8)
    assert counts[probs == 0].sum() == 0  # filtered tokens are never drawn
    support = probs > 0
    chi2, pval = stats.chisquare(counts[support], probs[support] * n)
    assert pval > 1e-3, (counts, probs * n)
    # log-probs are the tempered, unfiltered policy's
    ref = logits / temperature - np.log(np.exp(logits / temperature).sum())
    np.testing.assert_allclose(np.asarray(logp), ref[toks], rtol=1e-5, atol=1e-5)


class ConstLM(FakeLM):
    """Next-token logits are the same vector at every step of every row."""

    def __init__(self, logits: np.ndarray):
        super().__init__(vocab=logits.shape[0], dim=2)
        self.const = nnx.Variable(jnp.asarray(logits, jnp.float32))

    def _out(self, summed, count, pos):
        h = jnp.tanh(summed / jnp.maximum(count, 1)[..., None])
        return jnp.broadcast_to(self.const[...], h.shape[:-1] + self.const.shape), h


@pytest.mark.slow
def test_generate_draws_independently_per_row_and_step_from_the_filtered_distribution():
    from scipy import stats

    tok = small_tokenizer()
    logits = np.full(len(tok), -8.0, np.float32)
    logits[[10, 20, 30, 40, 50, 60]] = [2.0, 1.6, 1.2, 0.8, 0.4, 0.0]
    cfg = _cfg(max_new_tokens=24, temperature=0.8, top_k=5, top_p=0.9, batch_buckets=(64,), eos_token_ids=(2,))
    out = Engine(tok, cfg).generate(ConstLM(logits), [[5]] * 64, jax.random.key(99))
    assert (out.lengths == 24).all()
    probs = _filtered_probs_oracle(logits.astype(np.float64), 0.8, 5, 0.9)
    counts = np.bincount(out.tokens.ravel(), minlength=len(tok))
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert support.sum() == 4  # top-k 5, then top-p 0.9 keeps 4
    _, pval = stats.chisquare(counts[support], probs[support] * out.tokens.size)
    assert pval > 1e-3, (counts[support], probs[support] * out.tokens.size)
    assert len({tuple(r) for r in out.tokens}) == 64  # no two rows share their draws


@pytest.mark.parametrize("greedy", [True, False])
def test_ids_the_tokenizer_lacks_are_never_drawn_and_are_outside_the_softmax(greedy):
    # A padded embedding (Qwen2.5: 151,936 rows for ~151,665 tokens): the logits are 4 wider than the
    # tokenizer and the top logit is a padding id.
    tok = small_tokenizer()
    n = len(tok)
    logits = np.random.default_rng(0).normal(size=n + 4).astype(np.float32)
    logits[n + 2] = 9.0
    cfg = _cfg(max_new_tokens=16, temperature=1.0, greedy=greedy, batch_buckets=(64,), eos_token_ids=(n + 3,))
    out = Engine(tok, cfg).generate(ConstLM(logits), [[5]] * 64, jax.random.key(7))
    assert (out.tokens < n).all() and (out.lengths == 16).all()
    if greedy:
        assert (out.tokens == int(np.argmax(logits[:n]))).all()
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:n])))
    np.testing.assert_allclose(out.logprobs, want[out.tokens], rtol=1e-5, atol=1e-6)


def test_greedy_picks_argmax_with_lowest_id_on_ties():
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 5.0, 0.0]])
    toks, logp = sample_tokens(logits, jax.random.split(jax.random.key(0), 2), 0, 1.0, greedy=True)
    np.testing.assert_array_equal(np.asarray(toks), [1, 0])
    np.testing.assert_allclose(np.asarray(logp), np.asarray(jax.nn.log_softmax(logits))[[0, 1], [1, 0]], rtol=1e-6)


def test_first_argmax_equals_numpy_argmax_with_ties_infinities_and_nan():
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(64, 37)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, [4, 20]] = np.inf
    x[7, [9, 30]] = np.nan  # NumPy/JAX argmax: the first NaN
    x[8, 0] = np.nan
    x[9, 36] = np.nan
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(got[[5, 6, 7, 8, 9]], [0, 4, 9, 0, 36])
    np.testing.assert_array_equal(
        np.asarray(first_argmax(jnp.asarray(x.reshape(4, 16, 37)))), np.argmax(x.reshape(4, 16, 37), axis=-1)
    )


# -- the Engine on fake models ------------------------------------------------------------------


def _cfg(**kw):
    base = dict(max_new_tokens=12, stop_strings=(), batch_buckets=(4, 8), length_buckets=(8, 16), eos_token_ids=(2,))
    base.update(kw)
    return SamplerConfig(**base)


@pytest.mark.slow
def test_greedy_generate_equals_stepwise_argmax_over_the_full_forward():
    tok = small_tokenizer()
    model = FakeLM(vocab=len(tok), dim=16, seed=3)
    sampler = Engine(tok, _cfg(greedy=True))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, len(tok), size=n)) for n in (3, 8, 5, 11, 1)]
    out = sampler.generate(model, prompts, jax.random.key(0))
    assert isinstance(out, SampleOutput) and out.tokens.shape == (5, 12) and out.fingerprints.shape == (5, 16)
    # Step-by-step argmax for one prompt, the slow way (no cache, one full forward per token).
    ref = greedy_reference(model, prompts[1], 12, (2,))
    np.testing.assert_array_equal(out.tokens[1, : out.lengths[1]], ref)
    # All prompts: the full forward (no cache) teacher-forced on the sampled tokens takes the same argmax
    # at every response position (so stepwise greedy decoding reproduces them), with the same log-probs.
    seqs = [p + out.tokens[i, : out.lengths[i]].tolist() for i, p in enumerate(prompts)]
    width = max(map(len, seqs))
    ids = jnp.asarray([s_ + [0] * (width - len(s_)) for s_ in seqs], jnp.int32)
    mask = jnp.asarray([[1] * len(s_) + [0] * (width - len(s_)) for s_ in seqs], jnp.int32)
    logits = np.asarray(model(ids, mask))
    for i, p in enumerate(prompts):
        n = int(out.lengths[i])
        resp = out.tokens[i, :n]
        assert n == 12 or resp[-1] == 2
        assert 2 not in resp[:-1].tolist()
        pos = np.arange(len(p) - 1, len(p) - 1 + n)
        np.testing.assert_array_equal(resp, logits[i, pos].argmax(-1))
        assert (out.tokens[i, n:] == tok.pad_token_id).all() and (out.logprobs[i, n:] == 0).all()
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[i, pos]), axis=-1))
        np.testing.assert_allclose(out.logprobs[i, :n], lp[np.arange(n), resp], atol=1e-4)


@pytest.mark.slow
def test_sampling_stops_right_after_stop_text_and_at_eos():
    tok = small_tokenizer()
    v = len(tok)
    texts = [
        "<think>x</think><action>get 2 iron ingot</action>.\nmore text",
        "<action>inventory</act",
        "abc</action>",
        "a/b <a> café",
    ]
    prompt_len = 3
    script = np.full((4, 64), tok.encode("b")[0], np.int32)
    for r, t in enumerate(texts):
        ids = tok.encode(t)
        script[r, prompt_len : prompt_len + len(ids)] = ids
    script[1, prompt_len + len(tok.encode(texts[1]))] = tok.eos_token_id
    model = ScriptedLM(script, v)
    sampler = Engine(tok, _cfg(stop_strings=("</action>",), max_new_tokens=40, eos_token_ids=None, temperature=0.5))
    out = sampler.generate(model, [[5, 6, 7]] * 4, jax.random.key(0))
    decoded = [tok.decode(out.tokens[r, : out.lengths[r]], skip_special_tokens=True) for r in range(4)]
    assert decoded[0] == "<think>x</think><action>get 2 iron ingot</action>."[: len(decoded[0])]
    assert "</action>" in decoded[0] and "</action>" not in tok.decode(out.tokens[0, : out.lengths[0] - 1])
    assert truncate_at_stop(decoded[0], ["</action>"]) == "<think>x</think><action>get 2 iron ingot</action>"
    assert out.tokens[1, out.lengths[1] - 1] == tok.eos_token_id  # EOS kept, then stop
    assert decoded[1] == "<action>inventory</act"
    assert decoded[2] == "abc</action>"
    # No stop: runs to the budget.
    assert out.lengths[3] == 40 and decoded[3].startswith("a/b <a> café") and decoded[3].endswith("bbb")


@pytest.mark.slow
def test_padding_rows_and_neighbours_never_change_a_row():
    tok = small_tokenizer()
    model = FakeLM(vocab=len(tok), dim=16, seed=5, scale=1.0)
    cfg = _cfg(max_new_tokens=10, batch_buckets=(1, 4, 8))
    sampler = Engine(tok, cfg)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, len(tok), size=n)) for n in (4, 15, 2, 7, 9)]
    key = jax.random.key(7)
    together = sampler.generate(model, prompts, key)  # bucket 8 (3 padding rows), T bucket 16
    for i in (2, 4):  # alone: (batch bucket 4, T bucket 8) and (8 with 3 padding rows more, 16)
        p = prompts[i]
        # Row i alone: bucket 1 or 4, T bucket 8 or 16; the row's key is fold_in(key, row index).
        alone = Engine(tok, cfg).generate(model, [[3]] * i + [p], key)
        np.testing.assert_array_equal(alone.tokens[i], together.tokens[i])
        assert alone.lengths[i] == together.lengths[i]
        np.testing.assert_allclose(alone.logprobs[i], together.logprobs[i], atol=1e-5)
        np.testing.assert_allclose(alone.fingerprints[i], together.fingerprints[i], atol=1e-5)


@pytest.mark.slow
def test_more_prompts_than_the_largest_bucket_are_served_in_chunks_with_the_same_rows():
    tok = small_tokenizer()
    model = FakeLM(vocab=len(tok), dim=8, seed=2, scale=1.0)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(3, len(tok), size=int(rng.integers(1, 8)))) for _ in range(11)]
    small = Engine(tok, _cfg(max_new_tokens=4, batch_buckets=(4,))).generate(model, prompts, jax.random.key(3))
    big = Engine(tok, _cfg(max_new_tokens=4, batch_buckets=(16,))).generate(model, prompts, jax.random.key(3))
    assert small.tokens.shape == (11, 4)
    np.testing.assert_array_equal(small.tokens, big.tokens)
    np.testing.assert_array_equal(small.lengths, big.lengths)


def test_max_new_tokens_one_returns_the_prefill_token():
    tok = small_tokenizer()
    model = FakeLM(vocab=len(tok), dim=8, seed=4)
    out = Engine(tok, _cfg(max_new_tokens=1, greedy=True)).generate(model, [[5, 9, 4]], jax.random.key(0))
    assert out.tokens.shape == (1, 1) and out.lengths.tolist() == [1]
    assert out.tokens[0, 0] == greedy_reference(model, [5, 9, 4], 1, ())[0]


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([], "at least one prompt"),
        ([[1, 2], []], r"prompts\[1\] must be a non-empty"),
        ([[1, 2], [1, 10_000]], r"prompts\[1\] holds token id 10000 outside"),
        ([[1] * 17], "prompt length 17 exceeds the largest SamplerConfig.length_buckets entry 16"),
        ([[1.5, 2.0]], r"prompts\[0\] must hold integer token ids"),
    ],
)
def test_generate_rejects_bad_prompts_with_the_field_named(prompts, match):
    tok = small_tokenizer()
    sampler = Engine(tok, _cfg())
    with pytest.raises(ValueError, match=match):
        sampler.generate(FakeLM(vocab=len(tok)), prompts, jax.random.key(0))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=0.0), "temperature must be finite and > 0"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an int >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(batch_buckets=(8, 4)), "batch_buckets must be a non-empty strictly ascending"),
        (dict(stop_strings=("",)), "stop_strings must be non-empty strings"),
    ],
)
def test_sampler_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplerConfig(**kw)


@pytest.mark.slow
def test_row_keys_make_a_row_depend_on_its_own_key_and_prompt_only():
    tok = small_tokenizer()
    model = FakeLM(vocab=len(tok), dim=16, seed=5, scale=1.0)
    sampler = Engine(tok, _cfg(max_new_tokens=10, batch_buckets=(1, 4, 8)))
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, len(tok), size=n)) for n in (4, 15, 2)]
    keys = jax.random.split(jax.random.key(11), 3)
    together = sampler.generate(model, prompts, jax.random.key(0), row_keys=keys)
    alone = sampler.generate(model, [prompts[2]], jax.random.key(1), row_keys=keys[2:])  # other row, bucket
    np.testing.assert_array_equal(alone.tokens[0], together.tokens[2])
    np.testing.assert_allclose(alone.logprobs[0], together.logprobs[2], atol=1e-5)
    # The default keys are fold_in(key, row): the same draw as passing them explicitly.
    default = sampler.generate(model, prompts, jax.random.key(0))
    explicit = sampler.generate(model, prompts, jax.random.key(9), row_keys=Engine.row_key_data(jax.random.key(0), 3))
    np.testing.assert_array_equal(default.tokens, explicit.tokens)
    assert not np.array_equal(default.tokens, together.tokens)
    with pytest.raises(ValueError, match="row_keys must be 3 keys"):
        sampler.generate(model, prompts, jax.random.key(0), row_keys=keys[:2])


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 5])
def test_the_accelerator_decode_step_has_no_loop_and_writes_the_state_in_place(top_k):
    # The compiled continuous-scheduler chunk (per-row KV writes) under both schedules, counted as
    # launch.decode_hlo counts: the CPU's step loops over rows (and bisects top-k); the accelerators'
    # has no loop inside a step (the threefry hash's CPU-only loops aside) and fewer kernels. Either
    # way every array of the donated state is written in place.
    from unittest import mock

    from bipace_jax.models import Qwen2Actor, Qwen2Config
    from bipace_jax.programs import abstract
    from bipace_jax.sampling.engine import abstract_programs
    from launch.decode_hlo import count

    cfg = Qwen2Config.tiny(num_hidden_layers=2)
    graphdef, params = nnx.split(Qwen2Actor(cfg))
    scfg = SamplerConfig(max_new_tokens=8, greedy=top_k == 0, top_k=top_k, eos_token_ids=(1,))
    got = {}
    for platform in ("cpu", "gpu"):
        jax.clear_caches()
        with (
            mock.patch("bipace_jax.models.qwen2.device_platform", lambda p=platform: p),
            mock.patch("bipace_jax.sampling.filters.device_platform", lambda p=platform: p),
        ):
            specs = abstract_programs(
                scfg, graphdef, abstract(params), vocab=cfg.vocab_size, prompt_len=16, slots=4, chunk=2
            )
            got[platform] = count(specs["decode_chunk"].lower().compile())
    threefry = 0 if top_k == 0 else 10  # two 5-round loops of XLA CPU's threefry lowering
    assert got["cpu"]["loop_iterations"] >= 2 * 4 + threefry + (32 if top_k else 0)  # 2 layers x 4 rows
    assert got["gpu"]["loop_iterations"] == threefry
    assert got["gpu"]["kernels"] < got["cpu"]["kernels"]
    n = 2 * cfg.num_hidden_layers + 3 + 8  # K and V per layer, mask, lengths, index; 8 per-row arrays
    assert got["cpu"]["state_aliased"] == got["gpu"]["state_aliased"] == f"{n}/{n}"
