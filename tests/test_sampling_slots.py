"""`Engine.slots` (the `SlotHandle`) under a host sampler mesh: the sharded slot programs draw what the unsharded
ones do; an idle slot serves its next prompt exactly.

(The slot programs' equality with the lockstep sampler is tested through the rollout, in
tests/test_rollout.py -k continuous.)
"""

import json
import textwrap

import numpy as np
import pytest

from tests.devices import run_on_cpu_devices

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from bipace_jax.models import Qwen2Actor, Qwen2Config
    from bipace_jax.sharding import make_mesh, shard_params
    from bipace_jax.sampling import Engine, SamplerConfig
    from tests.test_sampling import small_tokenizer

    tok = small_tokenizer()
    # every 7th id ends a response: the rows finish at several lengths and slots are refilled
    cfg = SamplerConfig(max_new_tokens=6, temperature=1.3, top_k=50, stop_strings=("</action>",),
                        batch_buckets=(2, 4), length_buckets=(16,), eos_token_ids=tuple(range(3, len(tok), 7)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(tok), size=int(rng.integers(1, 16))).tolist() for _ in range(5)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5), 5)))

    def play(engine, actor):
        # 3 slots for 5 prompts, chunks of 2 steps: a finished slot gets the next prompt
        ss = engine.slots(actor, 3, max_prompt=16, chunk=2)
        slots = ss.insert(ss.empty(), prompts[:3], [0, 1, 2], keys[:3])
        owner, out, nxt = {0: 0, 1: 1, 2: 2}, {}, 3
        while len(out) < 5:
            slots, _ = ss.decode(slots)
            done = ss.done(slots)
            for k in [k for k in owner if done[k]]:
                out[owner.pop(k)] = [np.asarray(x[0]).tolist() for x in ss.read(slots, [k])[:4]]
            free = [k for k in range(3) if k not in owner][: 5 - nxt]
            if free:
                slots = ss.insert(slots, prompts[nxt:nxt + len(free)], free, keys[nxt:nxt + len(free)])
                owner.update({k: nxt + j for j, k in enumerate(free)})
                nxt += len(free)
        return [out[i] for i in range(5)], ss, slots

    actor = Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tok)), rngs=nnx.Rngs(3))
    one, _, _ = play(Engine(tok, cfg), actor)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shard_params(actor, mesh)
    if "SCHEDULE" == "accelerator":  # the accelerators' schedule: per-row cache writes by scatter, lax.top_k
        import bipace_jax.models.qwen2, bipace_jax.sampling.filters
        bipace_jax.models.qwen2.device_platform = bipace_jax.sampling.filters.device_platform = lambda: "gpu"
    eight, ss, slots = play(Engine(tok, cfg, mesh=mesh), actor)
    specs = {n: str(x.sharding.spec) for n, x in
             dict(k=slots.cache.k[0], v=slots.cache.v[0], index=slots.cache.index, tokens=slots.tokens).items()}
    json.dump(dict(one=one, eight=eight, rows=ss.num_slots, inserts=ss.counters["insert_calls"], specs=specs), sys.stdout)
""")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["cpu", "accelerator"])
def test_slot_programs_sharded_over_8_cpu_devices_draw_the_unsharded_tokens(schedule):
    # "accelerator": the sharded programs use the accelerators' per-row writes and top-k (a scatter,
    # lax.top_k), the unsharded ones the CPU's (slice-write and bisection loops): the same tokens
    res = run_on_cpu_devices(_SCRIPT.replace("SCHEDULE", schedule))
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    # 3 slots over data x fsdp = 4 shards: 4 rows, the 4th always empty
    assert r["rows"] == 4 and r["inserts"] >= 2  # the slots freed were refilled
    # slots over the batch axes, the cache's 2 KV heads over tensor (as `kv_cache.cache_shardings`)
    assert r["specs"]["k"] == r["specs"]["v"] == "P(('data', 'fsdp'), 'tensor')"
    assert r["specs"]["index"] == r["specs"]["tokens"] == "P(('data', 'fsdp'),)"
    for i, (one, eight) in enumerate(zip(r["one"], r["eight"])):  # tokens, length, log-probs, fingerprint
        np.testing.assert_array_equal(eight[0], one[0], err_msg=f"prompt {i}")
        assert eight[1] == one[1], i
        np.testing.assert_allclose(eight[2], one[2], atol=1e-4)
        np.testing.assert_allclose(eight[3], one[3], atol=1e-4)
    lengths = [one[1] for one in r["one"]]
    assert len(set(lengths)) > 1 and len({tuple(one[0]) for one in r["one"]}) == 5  # rows really differ


def test_a_slot_left_idle_for_longer_than_its_cache_serves_its_next_prompt_exactly():
    """Slot 0 waits through more decode steps than its S columns while slot 1 plays prompt after
    prompt; its next prompt then gives the lockstep sampler's tokens and log-probs (an idle slot once
    counted positions past S, got NaN RoPE tables and poisoned its next game through 0 * NaN)."""
    import jax
    from flax import nnx

    from bipace_jax.models import Qwen2Actor, Qwen2Config
    from bipace_jax.sampling import Engine, SamplerConfig
    from tests.test_sampling import small_tokenizer

    tok = small_tokenizer()
    actor = Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tok)), rngs=nnx.Rngs(0))
    cfg = SamplerConfig(max_new_tokens=8, greedy=True, batch_buckets=(1, 2), length_buckets=(16,), eos_token_ids=(1,))
    sampler = Engine(tok, cfg)
    ss = sampler.slots(actor, 2, max_prompt=16, chunk=8)  # S = 16 + 8 columns per slot
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 8)))
    prompts = [[5 + i, 9, 12 + i, 7] for i in range(8)]
    slots = ss.insert(ss.empty(), prompts[:1], [0], keys[:1])
    steps = 0
    for j in range(1, 7):  # slot 0 ends after <= 8 tokens; slot 1 keeps decoding 6 prompts of 8 tokens
        slots = ss.insert(slots, prompts[j : j + 1], [1], keys[j : j + 1])
        while not ss.done(slots)[1]:
            slots, n = ss.decode(slots)
            steps += n
    assert steps > 24  # slot 0 sat through more steps than its columns
    slots = ss.insert(slots, prompts[7:], [0], keys[7:])
    while not ss.done(slots)[0]:
        slots, _ = ss.decode(slots)
    tokens, lengths, logps, _, timing = ss.read(slots, [0])
    assert timing is None  # rows read from slots carry no call timing
    ref = sampler.generate(actor, prompts[7:], jax.random.key(1), row_keys=keys[7:])
    assert np.isfinite(logps).all()
    np.testing.assert_array_equal(tokens, ref.tokens)
    np.testing.assert_array_equal(lengths, ref.lengths)
    np.testing.assert_allclose(logps, ref.logprobs, atol=1e-5)
