"""`sampling.Engine`'s surface: temperature per call (one compiled program for every value), timing on the
output, and `abstract_programs` giving the specs that run (the slot programs included, donated, sort-free)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from bipace_jax.models import Qwen2Actor, Qwen2Config
from bipace_jax.programs import abstract
from bipace_jax.sampling import Engine, SamplerConfig, programs
from tests.test_sampling import FakeLM, small_tokenizer


def _cfg(**kw):
    base = dict(max_new_tokens=8, stop_strings=(), batch_buckets=(4, 8), length_buckets=(16,), eos_token_ids=(2,))
    return SamplerConfig(**(base | kw))


def _prompts(vocab: int, n: int = 5, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(1, 16))).tolist() for _ in range(n)]


def test_a_per_call_temperature_draws_what_an_engine_configured_with_it_draws_without_a_recompile():
    tok = small_tokenizer()
    model = FakeLM(vocab=len(tok), dim=16, seed=5, scale=1.0)
    prompts, key = _prompts(len(tok)), jax.random.key(4)
    one = Engine(tok, _cfg(temperature=1.0))
    before = programs.decode._cache_size()
    hot = one.generate(model, prompts, key, temperature=2.5)
    cold = one.generate(model, prompts, key, temperature=0.3)
    assert programs.decode._cache_size() - before <= 1  # both temperatures ran one compiled decode loop
    for t, out in ((2.5, hot), (0.3, cold)):
        ref = Engine(tok, _cfg(temperature=t)).generate(model, prompts, key)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.logprobs, ref.logprobs)
    assert not np.array_equal(hot.tokens, cold.tokens)
    default = one.generate(model, prompts, key)  # None: the config's temperature
    np.testing.assert_array_equal(
        default.tokens, Engine(tok, _cfg(temperature=1.0)).generate(model, prompts, key).tokens
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_per_call_temperature_is_refused_by_name(bad):
    tok = small_tokenizer()
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        Engine(tok, _cfg()).generate(FakeLM(vocab=len(tok)), [[5, 6]], jax.random.key(0), temperature=bad)


def test_timing_comes_back_on_the_output_with_its_token_counts():
    tok = small_tokenizer()
    prompts = _prompts(len(tok), n=11)  # 2 chunks of the largest batch bucket (8)
    out = Engine(tok, _cfg()).generate(FakeLM(vocab=len(tok)), prompts, jax.random.key(1))
    t = out.timing
    assert t.prompt_tokens == t.prefill_tokens == sum(map(len, prompts))
    assert t.new_tokens == int(out.lengths.sum()) and t.prefill_s > 0 and t.decode_s > 0


def test_abstract_programs_are_the_specs_the_engine_runs():
    tok = small_tokenizer()
    actor = Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tok)), rngs=nnx.Rngs(0))
    engine = Engine(tok, _cfg(stop_strings=("</action>",), top_k=20, top_p=0.9))
    graphdef, params = nnx.split(actor)
    specs = engine.abstract_programs(
        graphdef, abstract(params), vocab=len(tok), prompt_len=16, batch=8, slots=3, insert_rows=(1, 4), chunk=2
    )
    assert set(specs) == {"prefill", "decode", "insert_1", "insert_4", "decode_chunk"}
    assert [s.donate_argnums for s in specs.values()] == [(), (3,), (3,), (3,), (3,)]
    # lockstep: what generate runs at batch 8, prompt bucket 16
    engine.generate(actor, _prompts(len(tok), n=6), jax.random.key(0))
    # continuous: 3 slots, an insert of 1 prompt (bucket 16), one chunk of 2 steps
    handle = engine.slots(actor, 3, max_prompt=16, chunk=2)
    state = handle.insert(handle.empty(), [[5] * 12], [1], np.zeros((1, 2), np.uint32))
    state, _ = handle.decode(state)
    ran = {k[0]: v for k, v in engine.specs.items()}
    assert set(ran) == {"prefill", "decode", "insert", "decode_chunk"}
    for name, want in (
        ("prefill", "prefill"),
        ("decode", "decode"),
        ("insert", "insert_1"),
        ("decode_chunk", "decode_chunk"),
    ):
        got = specs[want]
        assert ran[name].fn is got.fn, name
        assert jax.tree.structure(ran[name].args[2:]) == jax.tree.structure(got.args[2:]), name
        shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(ran[name].args[2:]) if hasattr(x, "dtype")]
        assert shapes == [(x.shape, x.dtype) for x in jax.tree.leaves(got.args[2:]) if hasattr(x, "dtype")], name
    assert specs["decode_chunk"].args[6:] == (2, True) and specs["decode"].args[6:] == (8, False)
    # and the abstract specs compile: the slot state is donated (aliased to the output) in both slot
    # programs, and no decode step sorts the vocabulary (top-k / top-p thresholds are bisected)
    for name in ("insert_1", "decode_chunk"):
        compiled = specs[name].lower().compile()
        assert compiled.memory_analysis().alias_size_in_bytes > 0, name
        assert " sort(" not in compiled.as_text(), name
