"""Qwen2Actor against HF transformers Qwen2ForCausalLM (torch, fp32), and its KV cache.

Parity is checked at real (unpadded) tokens: HF's outputs at padding columns are undefined
(fully masked query rows), ours are finite but equally meaningless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from bipace_jax.models import ActorOutput, KVCache, Qwen2Actor, Qwen2Config, load_hf_checkpoint  # noqa: E402
from bipace_jax.models import attention as attn  # noqa: E402
from bipace_jax.models import layers as layers  # noqa: E402
from tests.qwen_fixtures import build_hf_model, random_batch  # noqa: E402

pytestmark = pytest.mark.parity

TOL = 1e-4

# (name, HF overrides): tied/untied heads and head/kv-head ratios 4:2, 4:1, 4:4, 6:2 (explicit head_dim).
ARCHS = [
    ("tied_n4_k2", dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2)),
    ("untied_n4_k1", dict(tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=1)),
    ("tied_n4_k4", dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3)),
    (
        "untied_n6_k2_hd8",
        dict(tie_word_embeddings=False, num_attention_heads=6, num_key_value_heads=2, head_dim=8, vocab_size=320),
    ),
]


@pytest.fixture(scope="module", params=ARCHS, ids=[a[0] for a in ARCHS])
def hf_pair(request, tmp_path_factory):
    """(HF torch model, our actor loaded from its save_pretrained folder, checkpoint path)."""
    name, overrides = request.param
    model = build_hf_model(seed=len(name), **overrides)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    actor = load_hf_checkpoint(path)
    actor.matmul_precision = "highest"  # parity is checked at full fp32 matmuls on every backend
    return model, actor, path


def hf_forward(model, ids, mask):
    """HF forward with generate()'s position ids (cumsum of the mask)."""
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos, dtype=torch.long),
            output_hidden_states=True,
        )
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def last_real(mask):
    return np.array([np.flatnonzero(row)[-1] for row in mask], np.int32)


def normalise(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["left", "right"])
def test_logits_and_every_hidden_state_match_hf(hf_pair, padding):
    model, actor, _ = hf_pair
    ids, mask = random_batch(4, 11, model.config.vocab_size, padding=padding, seed=3, min_real=2)
    ref_logits, ref_hidden = hf_forward(model, ids, mask)
    out = actor(ids, mask, output_hidden_states=True)
    real = mask.astype(bool)
    assert out.logits.dtype == jnp.float32 and out.logits.shape == ref_logits.shape
    assert np.abs(np.asarray(out.logits) - ref_logits)[real].max() <= TOL
    assert len(out.hidden_states) == len(ref_hidden) == model.config.num_hidden_layers + 1
    for i, (ours, ref) in enumerate(zip(out.hidden_states, ref_hidden)):
        err = np.abs(np.asarray(ours) - ref)[real].max()
        assert err <= TOL, f"hidden state {i}: max error {err}"
    # The default fingerprint is HF's final normed hidden state at the last real token, L2-normalised.
    rows = np.arange(len(ids))
    want = normalise(ref_hidden[-1][rows, last_real(mask)])
    np.testing.assert_allclose(np.asarray(out.fingerprint), want, atol=1e-5)
    assert np.allclose(np.linalg.norm(np.asarray(out.fingerprint), axis=-1), 1.0, atol=1e-6)


@pytest.mark.slow
def test_fingerprint_layer_selects_hf_hidden_state(hf_pair):
    model, _, path = hf_pair
    ids, mask = random_batch(3, 9, model.config.vocab_size, padding="left", seed=4)
    _, ref_hidden = hf_forward(model, ids, mask)
    rows = np.arange(len(ids))
    cols = np.array([8, 5, 7], np.int32)
    for layer in (0, 1, -2):
        actor = load_hf_checkpoint(path, fingerprint_layer=layer)
        actor.matmul_precision = "highest"
        out = actor(ids, mask)
        np.testing.assert_allclose(
            np.asarray(out.fingerprint), normalise(ref_hidden[layer][rows, last_real(mask)]), atol=1e-5
        )
        # An explicit column per row picks that column instead.
        out = actor(ids, mask, fingerprint_index=cols)
        np.testing.assert_allclose(np.asarray(out.fingerprint), normalise(ref_hidden[layer][rows, cols]), atol=1e-5)


@pytest.mark.slow
def test_left_and_right_padding_give_the_same_outputs_at_real_tokens():
    actor = Qwen2Actor(Qwen2Config.tiny(num_key_value_heads=1), rngs=nnx.Rngs(3))
    ids_l, mask_l = random_batch(3, 8, 300, padding="left", seed=5, min_real=3)
    # Move each row's real tokens to the front (right padding).
    ids_r = np.zeros_like(ids_l)
    mask_r = np.zeros_like(mask_l)
    for b in range(3):
        real = ids_l[b][mask_l[b] == 1]
        ids_r[b, : len(real)] = real
        mask_r[b, : len(real)] = 1
    out_l, out_r = actor(ids_l, mask_l), actor(ids_r, mask_r)
    np.testing.assert_allclose(np.asarray(out_l.fingerprint), np.asarray(out_r.fingerprint), atol=1e-5)
    for b in range(3):
        n = mask_l[b].sum()
        np.testing.assert_allclose(np.asarray(out_l.logits[b, -n:]), np.asarray(out_r.logits[b, :n]), atol=1e-4)


@pytest.mark.slow
def test_jitted_split_state_forward_equals_eager():
    actor = Qwen2Actor(Qwen2Config.tiny(tie_word_embeddings=False), rngs=nnx.Rngs(4))
    ids, mask = random_batch(2, 7, 300, padding="left", seed=6)
    graphdef, state = nnx.split(actor)

    @jax.jit
    def forward(state, ids, mask):
        out = nnx.merge(graphdef, state)(ids, mask)
        return out.logits, out.fingerprint

    logits, fp = forward(state, ids, mask)
    eager = actor(ids, mask)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(eager.logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(fp), np.asarray(eager.fingerprint), atol=1e-6)


@pytest.mark.slow
def test_bf16_activations_keep_fp32_logits_and_stay_close(tmp_path):
    model = build_hf_model(seed=11, tie_word_embeddings=False)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    actor = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    assert actor.embed.embedding[...].dtype == jnp.bfloat16
    ids, mask = random_batch(2, 8, model.config.vocab_size, padding="left", seed=7)
    ref_logits, _ = hf_forward(model, ids, mask)
    out = actor(ids, mask)
    assert out.logits.dtype == jnp.float32 and out.fingerprint.dtype == jnp.float32
    real = mask.astype(bool)
    # bf16 has an 8-bit mantissa: errors are ~1e-2 of the logit scale, far from fp32's 1e-6.
    err = np.abs(np.asarray(out.logits) - ref_logits)[real].max()
    assert 0 < err <= 0.05 * np.abs(ref_logits).max()


# --------------------------------------------------------------------------------------------------
# KV cache.
def _extend(ids, mask, new_tokens):
    """The full-forward view of prompt + decoded tokens: [B, T + M] ids and mask."""
    return (
        np.concatenate([ids, new_tokens], axis=1),
        np.concatenate([mask, np.ones_like(new_tokens, dtype=mask.dtype)], axis=1),
    )


@pytest.mark.slow
@pytest.mark.parametrize("padding,layer", [("left", -1), ("right", 1)])
def test_prefill_then_decode_token_by_token_equals_full_forward(padding, layer):
    cfg = Qwen2Config.tiny(tie_word_embeddings=False, num_key_value_heads=1, num_hidden_layers=3)
    actor = Qwen2Actor(cfg, fingerprint_layer=layer, rngs=nnx.Rngs(1))
    ids, mask = random_batch(3, 6, cfg.vocab_size, padding=padding, seed=8, min_real=1)
    new = np.random.default_rng(9).integers(0, cfg.vocab_size, (3, 4)).astype(np.int32)
    full_ids, full_mask = _extend(ids, mask, new)
    full = actor(full_ids, full_mask, fingerprint_index=last_real(mask))

    cache = actor.init_cache(3, 12)
    assert isinstance(cache, KVCache) and len(cache.k) == len(cache.v) == 3
    assert cache.k[0].shape == (3, 1, 16, 12) and cache.v[0].shape == (3, 1, 12, 16)
    out, cache = actor.prefill(ids, mask, cache)
    assert isinstance(out, ActorOutput) and out.logits.shape == (3, cfg.vocab_size)
    np.testing.assert_allclose(
        np.asarray(out.logits), np.asarray(full.logits)[np.arange(3), last_real(mask)], atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(out.fingerprint), np.asarray(full.fingerprint), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cache.lengths), mask.sum(1))
    assert int(cache.index) == 6
    np.testing.assert_array_equal(np.asarray(cache.slot_mask[:, :6]), mask.astype(bool))
    for j in range(new.shape[1]):
        logits, cache = actor.decode_step(jnp.asarray(new[:, j]), cache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full.logits[:, 6 + j]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), mask.sum(1) + 4)
    assert int(cache.index) == 10


@pytest.mark.slow
def test_decode_step_with_a_per_row_index_equals_each_row_decoded_alone():
    # Rows prefilled to different widths (index 3 and 5) share one cache with index int32[2]: two
    # decode steps must give each row's logits and cache as its own shared-index cache does.
    cfg = Qwen2Config.tiny(num_hidden_layers=2)
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32) for t in (3, 5)]
    new = rng.integers(0, cfg.vocab_size, (2, 2)).astype(np.int32)

    @nnx.jit  # one program: eager, the per-row write loop takes seconds
    def run(actor, new):
        alone = [actor.prefill(p, jnp.ones_like(p), actor.init_cache(1, 8))[1] for p in prompts]
        both = KVCache(
            k=tuple(jnp.concatenate([alone[0].k[i], alone[1].k[i]]) for i in range(cfg.num_hidden_layers)),
            v=tuple(jnp.concatenate([alone[0].v[i], alone[1].v[i]]) for i in range(cfg.num_hidden_layers)),
            slot_mask=jnp.concatenate([alone[0].slot_mask, alone[1].slot_mask]),
            lengths=jnp.concatenate([alone[0].lengths, alone[1].lengths]),
            index=jnp.asarray([3, 5], jnp.int32),
        )
        got, want = [], []
        for j in range(2):
            logits, both = actor.decode_step(new[:, j], both)
            got.append(logits)
            for r in range(2):
                w, alone[r] = actor.decode_step(new[r : r + 1, j], alone[r])
                want.append(w[0])
        return jnp.stack(got), jnp.stack(want).reshape(2, 2, -1), both, alone

    got, want, both, alone = run(actor, jnp.asarray(new))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(both.index), [5, 7])
    for r in range(2):
        np.testing.assert_array_equal(np.asarray(both.slot_mask[r]), np.asarray(alone[r].slot_mask[0]))
        for i in range(cfg.num_hidden_layers):
            np.testing.assert_allclose(np.asarray(both.k[i][r]), np.asarray(alone[r].k[i][0]), atol=1e-6)
            np.testing.assert_allclose(np.asarray(both.v[i][r]), np.asarray(alone[r].v[i][0]), atol=1e-6)


def test_per_row_cache_writes_by_scatter_equal_the_slice_write_loop_and_numpy():
    # The accelerators' write (one scatter) and the CPU's (a loop of slice writes): each row's new
    # key/value lands at its own slot, everything else untouched; bitwise the same arrays.
    from bipace_jax.models.kv_cache import write_per_row

    rng = np.random.default_rng(5)
    b, kh, hd, s = 5, 2, 4, 9
    kc, vc = rng.normal(size=(b, kh, hd, s)).astype(np.float32), rng.normal(size=(b, kh, s, hd)).astype(np.float32)
    k, v = rng.normal(size=(b, kh, hd, 1)).astype(np.float32), rng.normal(size=(b, kh, 1, hd)).astype(np.float32)
    index = np.array([0, 8, 3, 3, 5], np.int32)
    want_k, want_v = kc.copy(), vc.copy()
    for r, i in enumerate(index):
        want_k[r, :, :, i], want_v[r, :, i, :] = k[r, :, :, 0], v[r, :, 0, :]
    for scatter in (True, False):
        got = jax.jit(functools.partial(write_per_row, scatter=scatter))(kc, vc, k, v, jnp.asarray(index))
        np.testing.assert_array_equal(np.asarray(got[0]), want_k)
        np.testing.assert_array_equal(np.asarray(got[1]), want_v)


@pytest.mark.slow
def test_jitted_prefill_and_decode_loop_equal_full_forward():
    cfg = Qwen2Config.tiny()
    actor = Qwen2Actor(cfg, rngs=nnx.Rngs(2))
    ids, mask = random_batch(4, 5, cfg.vocab_size, padding="left", seed=10)
    graphdef, state = nnx.split(actor)

    @jax.jit
    def generate_greedy(state, ids, mask):
        model = nnx.merge(graphdef, state)
        out, cache = model.prefill(ids, mask, model.init_cache(ids.shape[0], 9))

        def body(carry, _):
            logits, cache = carry
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, cache = model.decode_step(token, cache)
            return (logits, cache), (token, logits)

        _, (tokens, logits) = jax.lax.scan(body, (out.logits, cache), None, length=4)
        return tokens.T, jnp.swapaxes(logits, 0, 1)

    tokens, step_logits = generate_greedy(state, ids, mask)
    full_ids, full_mask = _extend(ids, mask, np.asarray(tokens))
    full = actor(full_ids, full_mask)
    # Greedy tokens are the argmax of the full forward's logits one column earlier.
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(full.logits[:, 4:8]), axis=-1))
    np.testing.assert_allclose(np.asarray(step_logits), np.asarray(full.logits[:, 5:9]), atol=1e-5)


@pytest.mark.slow
def test_cache_entry_points_reject_bad_shapes_before_compiling():
    actor = Qwen2Actor(Qwen2Config.tiny(), rngs=nnx.Rngs(0))
    ids, mask = random_batch(2, 6, 512)
    with pytest.raises(ValueError, match="exceeds cache max_length"):
        actor.prefill(ids, mask, actor.init_cache(2, 4))
    with pytest.raises(ValueError, match="cache batch 3 != input batch 2"):
        actor.prefill(ids, mask, actor.init_cache(3, 8))
    with pytest.raises(ValueError, match=r"token_ids must be int32\[B=2\]"):
        actor.decode_step(jnp.zeros((2, 1), jnp.int32), actor.init_cache(2, 8))
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        actor.init_cache(2, 0)


def test_forward_rejects_bad_inputs_with_the_field_named():
    actor = Qwen2Actor(Qwen2Config.tiny(), rngs=nnx.Rngs(0))
    ids, mask = random_batch(2, 6, 512)
    with pytest.raises(ValueError, match="attention_mask shape"):
        actor(ids, mask[:, :5])
    with pytest.raises(ValueError, match=r"input_ids must be int32\[B, T\]"):
        actor(ids[0], mask[0])
    with pytest.raises(ValueError, match=r"input_ids at real tokens must lie in \[0, 512\)"):
        actor(ids + 512, mask)
    with pytest.raises(ValueError, match="attention_mask row 1 has no real token"):
        actor(ids, np.array([[1] * 6, [0] * 6], np.int32))
    with pytest.raises(ValueError, match="fingerprint_index must be int32"):
        actor(ids, mask, fingerprint_index=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="fingerprint_layer must be an int in"):
        Qwen2Actor(Qwen2Config.tiny(), fingerprint_layer=3)
    with pytest.raises(
        ValueError, match=r"matmul_precision must be one of \('default', 'high', 'highest'\), got 'tf32'"
    ):
        Qwen2Actor(Qwen2Config.tiny(), matmul_precision="tf32")


@pytest.mark.parametrize("precision,hlo", [("default", "DEFAULT"), ("high", "HIGH"), ("highest", "HIGHEST")])
def test_matmul_precision_reaches_every_dot_of_forward_prefill_and_decode(precision, hlo):
    actor = Qwen2Actor(Qwen2Config.tiny(num_hidden_layers=1), rngs=nnx.Rngs(0), matmul_precision=precision)
    ids, mask = random_batch(2, 4, 512, padding="none")
    cache = actor.init_cache(2, 8)
    programs = {
        "forward": jax.jit(lambda i, m: actor(i, m).logits).lower(jnp.asarray(ids), jnp.asarray(mask)),
        "prefill": jax.jit(lambda i, m: actor.prefill(i, m, cache)[0].logits).lower(
            jnp.asarray(ids), jnp.asarray(mask)
        ),
        "decode": jax.jit(lambda t: actor.decode_step(t, cache)[0]).lower(jnp.zeros((2,), jnp.int32)),
    }
    for name, lowered in programs.items():
        dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
        assert len(dots) >= 7, name  # q, k, v, o, scores, values, MLP x3, head
        assert all(f"precision = [{hlo}, {hlo}]" in line for line in dots), (name, dots[0])


def test_out_of_range_ids_under_jit_give_nan_not_a_clamped_token():
    actor = Qwen2Actor(Qwen2Config.tiny(), rngs=nnx.Rngs(0))
    ids, mask = random_batch(2, 4, 512, padding="none")
    ids[0, 2] = 600
    logits = nnx.jit(lambda m, i, k: m(i, k).logits)(actor, jnp.asarray(ids), jnp.asarray(mask))
    assert np.isnan(np.asarray(logits[0, 2:])).all() and np.isfinite(np.asarray(logits[1])).all()


@pytest.mark.slow
def test_padding_columns_may_hold_any_id():
    actor = Qwen2Actor(Qwen2Config.tiny(), rngs=nnx.Rngs(0))
    ids, mask = random_batch(3, 5, 512, padding="left", seed=13, min_real=2)
    odd = np.where(mask == 1, ids, -1).astype(np.int32)
    np.testing.assert_array_equal(
        np.asarray(actor(odd, mask).logits)[mask == 1], np.asarray(actor(ids, mask).logits)[mask == 1]
    )


@pytest.mark.slow
def test_forward_hidden_and_lm_logits_compose_to_the_forward():
    actor = Qwen2Actor(Qwen2Config.tiny(tie_word_embeddings=False), fingerprint_layer=1, rngs=nnx.Rngs(8))
    ids, mask = random_batch(2, 6, 512, padding="left", seed=12)
    h, fp = actor.forward_hidden(ids, mask)
    full = actor(ids, mask)
    assert h.shape == (2, 6, 64)
    np.testing.assert_allclose(np.asarray(fp), np.asarray(full.fingerprint), atol=1e-6)
    # Chunked over T, as a trainer would do for a large vocabulary.
    chunks = [actor.lm_logits(h[:, i : i + 2]) for i in range(0, 6, 2)]
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), np.asarray(full.logits), atol=1e-6)


@pytest.mark.parametrize("remat,scan", [("none", False), ("full", True)])
def test_last_layer_at_query_columns_equals_those_columns_of_the_full_forward(remat, scan):
    # The learner's pass runs the last layer only where the head reads (forward_hidden(query_index=)):
    # the same hidden states and the same gradients as cutting those columns out of the full forward.
    actor = Qwen2Actor(Qwen2Config.tiny(num_hidden_layers=3), remat=remat, scan_layers=scan, rngs=nnx.Rngs(4))
    ids, mask = random_batch(3, 12, 512, padding="left", seed=21, min_real=4)
    cols = np.array([[11, 4, 7, 8], [10, 11, 0, 9], [9, 9, 2, 11]], np.int32)
    g, params, rest = nnx.split(actor, nnx.Param, ...)
    w = jax.random.normal(jax.random.key(0), (3, 4, 64))  # a weighted sum: the gradient sees every column

    def cut(p):
        h, _ = nnx.merge(g, p, rest).forward_hidden(ids, mask)
        return jnp.take_along_axis(h, jnp.asarray(cols)[..., None], axis=1)

    def at(p):
        h, fp = nnx.merge(g, p, rest).forward_hidden(ids, mask, query_index=cols)
        assert fp is None  # the default fingerprint (final state) is not computed there
        return h

    h_cut, h_at = cut(params), at(params)
    assert h_at.shape == (3, 4, 64)
    np.testing.assert_allclose(np.asarray(h_at), np.asarray(h_cut), atol=2e-6)
    grads = [jax.grad(lambda p, f=f: jnp.sum(f(p) * w))(params) for f in (cut, at)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        # float summation order only: 1e-5 of the leaf's largest entry (the scores' sums differ in order)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(grads[1])) > 1e-3  # a real gradient
    # Packed lines: the same columns of forward_packed.
    seg = np.array([[1] * 5 + [2] * 7, [1] * 12, [1] * 3 + [2] * 6 + [0] * 3], np.int32)
    full = actor.forward_packed(ids, seg)
    np.testing.assert_allclose(
        np.asarray(actor.forward_packed(ids, seg, query_index=cols)),
        np.take_along_axis(np.asarray(full), cols[..., None], axis=1),
        atol=2e-6,
    )
    with pytest.raises(ValueError, match=r"query_index must be int32\[B=3, Q\]"):
        actor.forward_hidden(ids, mask, query_index=cols[0])


# --------------------------------------------------------------------------------------------------
# Attention schedules (bipace_jax.models.attention): each must give the reference path's values.
def test_row_chunk_is_the_largest_divisor_whose_scores_fit():
    assert attn.row_chunk(6, 10, budget=100) == 6  # 60 bytes fit: no chunking
    assert attn.row_chunk(12, 30, budget=100) == 3  # 3 rows fit (90 <= 100), 3 divides 12
    assert attn.row_chunk(10, 30, budget=100) == 2  # 3 does not divide 10
    assert attn.row_chunk(7, 30, budget=100) == 1  # prime batch: one row at a time
    assert attn.row_chunk(4, 500, budget=100) == 1  # one row exceeds the budget


def test_causal_blocks_split_equally():
    assert attn.CPU_CAUSAL_BLOCK == 32 and attn.CPU_MAX_CAUSAL_BLOCKS == 8
    assert [attn.causal_blocks(t) for t in (6, 32, 48, 64, 96, 128, 256, 512, 2048)] == [1, 1, 1, 2, 3, 4, 8, 8, 8]
    assert attn.causal_blocks(256, max_blocks=5) == 4  # 8 blocks capped at 5 -> the largest divisor, 4
    assert attn.causal_blocks(12, block=3) == 4


def test_schedule_is_chosen_by_the_devices_the_computation_runs_on(monkeypatch):
    assert attn.device_platform() == "cpu"
    # CPU without a mesh: 64 rows of [4 heads x 128 x 128] fp32 scores are 16 MiB -> chunks of 8 rows.
    assert attn.choose_schedule(64, 128, 128, 4, causal=True) == attn.Schedule(row_chunk=8, causal_blocks=4)
    assert attn.choose_schedule(64, 1, 192, 4, causal=False) == attn.Schedule(row_chunk=64, causal_blocks=1)
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):  # a mesh: the partitioner's call
        assert attn.device_platform() == "cpu"
        assert attn.choose_schedule(64, 128, 128, 4, causal=True) == attn.REFERENCE
    with jax.default_device(jax.devices("cpu")[0]):
        assert attn.device_platform() == "cpu"
    monkeypatch.setattr(attn, "device_platform", lambda: "gpu")  # accelerators fuse attention themselves
    assert attn.choose_schedule(64, 128, 128, 4, causal=True) == attn.REFERENCE


def _self_attention_inputs(padding, b=6, t=12, n=4, k=2, hd=8, seed=0):
    rng = np.random.default_rng(seed)
    q, kk, v = (
        jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, t, n, hd), (b, t, k, hd), (b, t, k, hd))
    )
    _, pad = random_batch(b, t, 100, padding=padding, seed=seed + 1, min_real=2)
    real = pad.astype(bool)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & real[:, None, :])
    return q, kk, v, mask, real


SELF_SCHEDULES = [
    attn.Schedule(row_chunk=1),
    attn.Schedule(row_chunk=3),
    attn.Schedule(causal_blocks=2),
    attn.Schedule(causal_blocks=4),
    attn.Schedule(row_chunk=2, causal_blocks=3),
]


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("schedule", SELF_SCHEDULES, ids=str)
def test_every_self_attention_schedule_equals_the_reference(schedule, padding):
    """Values at real query columns and gradients of q, k, v (padding columns attend nothing: their
    outputs are meaningless either way and weighted 0 here, as everywhere downstream)."""
    q, k, v, mask, real = _self_attention_inputs(padding)
    weights = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32) * real[:, :, None, None]

    def run(s):
        def loss(q, k, v):
            out = attn.attention(q, k, v, mask, causal=True, schedule=s)
            return jnp.sum(out * weights), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    out, grads = run(schedule)
    ref, ref_grads = run(attn.REFERENCE)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(ref)[real]).max() > 0.1
    for g, g_ref, name in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule", [attn.Schedule(row_chunk=1), attn.Schedule(row_chunk=2), attn.Schedule(row_chunk=3)], ids=str
)
def test_every_decode_schedule_over_the_cache_layout_equals_the_reference(schedule):
    """One query per row over a KV cache (keys [B, K, Hd, S], values [B, K, S, Hd]) with scattered
    real slots; the reference over the cache layout also equals it over the [B, S, K, Hd] layout."""
    b, n, kh, hd, s = 6, 6, 2, 8, 9
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(b, 1, n, hd)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, s, kh, hd)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(b, s, kh, hd)), jnp.float32)
    slots = rng.random((b, s)) < 0.6
    slots[:, 0] = True
    mask = jnp.asarray(slots[:, None, :])
    k_cache, v_cache = jnp.transpose(keys, (0, 2, 3, 1)), jnp.transpose(values, (0, 2, 1, 3))

    def run(s):
        f = lambda q, k, v: jnp.sum(attn.attention(q, k, v, mask, cache_layout=True, schedule=s) ** 2)
        return attn.attention(q, k_cache, v_cache, mask, cache_layout=True, schedule=s), jax.grad(f, argnums=(0, 1, 2))(
            q, k_cache, v_cache
        )

    out, grads = run(schedule)
    ref, ref_grads = run(attn.REFERENCE)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
    plain = attn.attention(q, keys, values, mask, schedule=attn.REFERENCE)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_attention_refuses_a_schedule_that_does_not_fit():
    q, k, v, mask, _ = _self_attention_inputs("left")
    with pytest.raises(ValueError, match="row_chunk 4 does not divide the batch 6"):
        attn.attention(q, k, v, mask, causal=True, schedule=attn.Schedule(row_chunk=4))
    with pytest.raises(ValueError, match="causal blocks need causal self-attention"):
        attn.attention(q, k, v, mask, schedule=attn.Schedule(causal_blocks=2))
    with pytest.raises(ValueError, match="causal blocks need causal self-attention"):
        attn.attention(q, k, v, mask, causal=True, schedule=attn.Schedule(causal_blocks=5))


@pytest.mark.slow
def test_cpu_row_chunked_attention_equals_unchunked_forward_cache_and_gradients(monkeypatch):
    """The actor with attention over row chunks (what large CPU batches get) gives the unchunked outputs."""
    actor = Qwen2Actor(Qwen2Config.tiny(num_key_value_heads=1), rngs=nnx.Rngs(10))
    ids, mask = random_batch(6, 7, 512, padding="left", seed=16)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    new = jnp.asarray(np.random.default_rng(17).integers(0, 512, (6,)), jnp.int32)

    def run(model):
        out = model(ids, mask)
        first, cache = model.prefill(ids, mask, model.init_cache(6, 9))
        step, cache = model.decode_step(new, cache)
        return out.logits, out.fingerprint, first.logits, step

    def loss(model):
        return jnp.sum(jax.nn.log_softmax(model(ids, mask).logits)[..., 5] * mask)

    ref = run(actor)
    ref_grads = nnx.grad(loss)(actor)
    # One row's scores in the forward: T * N * S * 4 bytes; allow two rows -> chunks of 2 of 6.
    monkeypatch.setattr(attn, "CPU_SCORES_BYTES", 2 * 7 * 4 * 7 * 4)
    assert attn.choose_schedule(6, 7, 7, 4, causal=False).row_chunk == 2
    for a, b in zip(run(actor), ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    grads = nnx.grad(loss)(actor)
    for (path, g), (_, g_ref) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        np.testing.assert_allclose(
            np.asarray(g.get_value()), np.asarray(g_ref.get_value()), rtol=1e-4, atol=1e-5, err_msg=str(path)
        )


def test_cpu_dense_gradient_is_xlas_own_for_both_operand_orders_and_off_under_a_mesh():
    """`layers.dense`'s CPU VJP (the narrower operand transposed: x's when K <= N, dy's when K > N) gives
    the plain product's gradients; under a mesh the plain product runs."""
    rng = np.random.default_rng(3)
    assert layers.cpu_dense_gradient()
    for k, n in ((3, 7), (7, 2)):
        x = jnp.asarray(rng.normal(size=(2, 5, k)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
        assert "custom_vjp_call" in str(jax.make_jaxpr(layers.dense)(x, w))
        got = jax.grad(lambda x, w: jnp.sum(jnp.sin(layers.dense(x, w))), argnums=(0, 1))(x, w)
        want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])):
        assert not layers.cpu_dense_gradient()
        assert "custom_vjp_call" not in str(jax.make_jaxpr(layers.dense)(x, w))


@pytest.mark.slow
def test_the_cpu_gradient_switches_keep_the_actors_gradients(monkeypatch):
    """The actor's loss gradient with `layers.CPU_DENSE_VJP` and `attention.CPU_REMAT_ROW_CHUNKS` on (the
    CPU default) equals XLA's own with both off, attention over row chunks of 2 rows."""
    actor = Qwen2Actor(Qwen2Config.tiny(num_key_value_heads=1), rngs=nnx.Rngs(10))
    ids, mask = random_batch(6, 7, 512, padding="left", seed=16)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    monkeypatch.setattr(attn, "CPU_SCORES_BYTES", 2 * 7 * 4 * 7 * 4)

    def grads():
        return nnx.grad(lambda m: jnp.sum(jax.nn.log_softmax(m(ids, mask).logits)[..., 5] * mask))(actor)

    new = grads()
    monkeypatch.setattr(layers, "CPU_DENSE_VJP", False)
    monkeypatch.setattr(attn, "CPU_REMAT_ROW_CHUNKS", False)
    ref = grads()
    for (path, g), (_, g_ref) in zip(nnx.to_flat_state(new), nnx.to_flat_state(ref)):
        np.testing.assert_allclose(
            np.asarray(g.get_value()), np.asarray(g_ref.get_value()), rtol=1e-4, atol=1e-6, err_msg=str(path)
        )


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["left", "right"])
def test_causal_query_blocks_equal_one_block_forward_prefill_and_gradients(monkeypatch, padding):
    """The actor with causal self-attention in query blocks (CPU, T >= 2 blocks) gives the one-block
    outputs at real tokens, the same cache at real slots and the same gradients."""
    actor = Qwen2Actor(Qwen2Config.tiny(num_hidden_layers=3), fingerprint_layer=1, rngs=nnx.Rngs(13))
    ids, mask = random_batch(4, 12, 512, padding=padding, seed=21, min_real=2)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    real = np.asarray(mask).astype(bool)

    def run():
        out = actor(ids, mask, output_hidden_states=True)
        first, cache = actor.prefill(ids, mask, actor.init_cache(4, 14))
        grads = nnx.grad(lambda m: jnp.sum(jax.nn.log_softmax(m(ids, mask).logits)[..., 7] * mask))(actor)
        at_real = [np.asarray(a)[real] for a in (out.logits, *out.hidden_states)]
        # Cache slots [0, 12) hold the prompt columns: keys L x [B, K, Hd, S], values L x [B, K, S, Hd].
        k = np.moveaxis(np.stack(cache.k)[..., :12], -1, 2)[:, real]
        v = np.moveaxis(np.stack(cache.v)[..., :12, :], -2, 2)[:, real]
        return [*at_real, out.fingerprint, first.logits, k, v, *[g.get_value() for _, g in nnx.to_flat_state(grads)]]

    monkeypatch.setattr(attn, "CPU_CAUSAL_BLOCK", 10**6)
    assert attn.choose_schedule(4, 12, 12, 4, causal=True).causal_blocks == 1
    ref = run()
    monkeypatch.setattr(attn, "CPU_CAUSAL_BLOCK", 3)
    assert attn.choose_schedule(4, 12, 12, 4, causal=True).causal_blocks == 4
    for a, b in zip(run(), ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_rope_tables_looked_up_by_position_equal_the_direct_ones():
    from bipace_jax.models.layers import rope_cos_sin

    positions = jnp.asarray([[0, 1, 2, 7], [3, 3, 0, 5]], jnp.int32)
    direct = rope_cos_sin(positions, 16, 10000.0)
    looked_up = rope_cos_sin(positions, 16, 10000.0, num_positions=8)
    for a, b in zip(direct, looked_up):
        assert b.shape == (2, 4, 16)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A position outside [0, num_positions) gives NaN tables, never a clamped position's.
    cos, sin = rope_cos_sin(jnp.asarray([[8, 1]], jnp.int32), 16, 10000.0, num_positions=8)
    assert np.isnan(np.asarray(cos[0, 0])).all() and np.isnan(np.asarray(sin[0, 0])).all()
    assert np.isfinite(np.asarray(cos[0, 1])).all()


# fingerprint 2 and 3 cut the scan in two (3: just before the prefill's unrolled last layer);
# remat=True (= "full") on the unrolled layers
@pytest.mark.slow
@pytest.mark.parametrize(
    "policy,fingerprint_layer,scan", [("none", 2, True), ("save_dots", 0, True), ("full", 3, True), (True, -1, False)]
)
def test_remat_policies_and_scanned_layers_give_the_plain_outputs_gradients_and_cache(policy, fingerprint_layer, scan):
    cfg = Qwen2Config.tiny(num_hidden_layers=4)
    actor = Qwen2Actor(cfg, fingerprint_layer=fingerprint_layer, rngs=nnx.Rngs(3))
    ids, mask = random_batch(3, 9, cfg.vocab_size, padding="left", seed=15)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def loss(model):
        out = model(ids, mask)
        return jnp.sum(jax.nn.log_softmax(out.logits)[..., 5] * mask) + jnp.sum(out.fingerprint[:, :3])

    grad = nnx.jit(nnx.value_and_grad(loss))
    value, grads = grad(actor)
    ref_out, ref_cache = actor.prefill(ids, mask, actor.init_cache(3, 12))
    actor.remat, actor.scan_layers = policy, scan
    value_s, grads_s = grad(actor)
    np.testing.assert_allclose(float(value_s), float(value), rtol=1e-6)
    for (path, g), (_, g_s) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_s)):
        np.testing.assert_allclose(
            np.asarray(g_s.get_value()), np.asarray(g.get_value()), rtol=1e-4, atol=1e-5, err_msg=str(path)
        )
    out, cache = actor.prefill(ids, mask, actor.init_cache(3, 12))
    np.testing.assert_allclose(out.logits, ref_out.logits, atol=2e-5)
    np.testing.assert_allclose(out.fingerprint, ref_out.fingerprint, atol=2e-6)
    np.testing.assert_allclose(cache.k, ref_cache.k, atol=2e-5)
    np.testing.assert_allclose(cache.v, ref_cache.v, atol=2e-5)


def test_unknown_remat_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="remat must be a bool or one of"):
        Qwen2Actor(Qwen2Config.tiny(), remat="dots")


def _causal_case(t=384, seed=21):
    rng = np.random.default_rng(seed)
    b, n, kh, hd = 2, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32) for h in (n, kh, kh))
    real = np.ones((b, t), bool)
    real[0, :37] = False  # left padding on one row
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & real[:, None, :])
    return q, k, v, mask, real


@pytest.mark.slow
def test_tpu_splash_kernel_equals_the_reference_at_real_columns_values_and_gradients():
    # The Pallas kernel in interpret mode (the TPU path's own code, run on CPU), 3 blocks of 128.
    q, k, v, mask, real = _causal_case()

    def loss(fn, q):
        return jnp.sum(jnp.where(real[..., None, None], fn(q), 0.0) ** 2)

    ref = functools.partial(attn.attention, k=k, v=v, mask=mask, causal=True, schedule=attn.REFERENCE)
    splash = functools.partial(attn.splash_attention, k=k, v=v, key_mask=mask[:, -1, :], interpret=True)
    np.testing.assert_allclose(np.asarray(splash(q))[real], np.asarray(ref(q))[real], atol=2e-6)
    np.testing.assert_allclose(
        jax.grad(functools.partial(loss, splash))(q), jax.grad(functools.partial(loss, ref))(q), atol=2e-5
    )
    with pytest.raises(ValueError, match="multiple of 128"):
        attn.splash_attention(q[:, :100], k[:, :100], v[:, :100], mask[:, -1, :100])


@pytest.mark.parametrize("packed", [False, True])
def test_gpu_fused_attention_equals_the_reference_at_real_columns_values_and_gradients(packed):
    # The GPU path's function with XLA's implementation (what a GPU without a usable cuDNN kernel
    # runs; on CPU the default's cuDNN attempt falls back to it): 4 query heads over 2 KV heads, left
    # padding, and packed rows (causal within 3 segments, the dense mask).
    q, k, v, mask, real = _causal_case(t=40)
    if packed:
        seg = np.repeat(np.array([[1] * 15 + [2] * 20 + [0] * 5]), 2, axis=0)
        seg[1, :9] = 3
        mask = jnp.asarray(np.tril(np.ones((40, 40), bool))[None] & (seg[:, :, None] == seg[:, None, :]))
        real = seg > 0

    def loss(fn, q):
        return jnp.sum(jnp.where(real[..., None, None], fn(q), 0.0) ** 2)

    ref = functools.partial(attn.attention, k=k, v=v, mask=mask, causal=True, schedule=attn.REFERENCE)
    xla = functools.partial(attn.fused_attention, k=k, v=v, mask=mask, implementation="xla")
    np.testing.assert_allclose(np.asarray(xla(q))[real], np.asarray(ref(q))[real], atol=1e-5)
    np.testing.assert_allclose(
        jax.grad(functools.partial(loss, xla))(q), jax.grad(functools.partial(loss, ref))(q), atol=1e-5
    )
    # no cuDNN here: the default falls back to XLA's implementation, bitwise
    np.testing.assert_array_equal(np.asarray(attn.fused_attention(q, k, v, mask)), np.asarray(xla(q)))
    with pytest.raises(RuntimeError, match="cuDNN"):
        attn.fused_attention(q, k, v, mask, implementation="cudnn")
