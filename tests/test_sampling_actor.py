"""Engine tests on the real Qwen2 actor: greedy parity with the full forward and with HF generate(),
and sharded over 8 emulated CPU devices equal to one device."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bipace_jax.models import load_hf_checkpoint, load_tokenizer
from bipace_jax.sampling import Engine, SamplerConfig
from tests.devices import run_on_cpu_devices

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.qwen_fixtures import write_tiny_qwen2_folder

    return write_tiny_qwen2_folder(tmp_path_factory.mktemp("qwen") / "ckpt", seed=1, weight_std=0.3)


@pytest.mark.slow
def test_greedy_equals_full_forward_argmax_and_hf_generate(tiny_folder):
    torch = pytest.importorskip("torch")
    import transformers

    actor = load_hf_checkpoint(tiny_folder)
    actor.matmul_precision = "highest"  # greedy ties must not depend on the backend's matmul mode
    tok = load_tokenizer(tiny_folder)
    m = 10
    sampler = Engine(
        tok, SamplerConfig(max_new_tokens=m, greedy=True, stop_strings=(), batch_buckets=(4,), length_buckets=(16, 48))
    )
    prompts = [
        tok.encode("craft 4 oak planks using 1 oak log"),
        tok.encode("get stick"),
        tok.encode("inventory : you see a cabinet and a drawer , take the apple from the fridge"),
    ]
    out = sampler.generate(actor, prompts, jax.random.key(0))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    eos = set(sampler.eos_token_ids)
    # Oracle 1: argmax of our actor's full forward (no cache) at every response position, teacher-forced
    # on the sampled tokens: if every position matches, step-by-step argmax decoding gives the same tokens.
    seqs = [p + out.tokens[i, : out.lengths[i]].tolist() for i, p in enumerate(prompts)]
    width = max(map(len, seqs))
    ids = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    mask = np.array([[1] * len(s) + [0] * (width - len(s)) for s in seqs], np.int32)  # right padding
    last_prompt = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
    full = nnx.jit(lambda a, i, m, f: a(i, m, fingerprint_index=f))(
        actor, jnp.asarray(ids), jnp.asarray(mask), last_prompt
    )
    # The checkpoint pads its vocabulary (512 rows, 384 tokens, as Qwen2.5 pads 151,665 to 151,936):
    # the sampler only draws ids the tokenizer has, so both oracles are restricted to them.
    support = len(tok)
    assert support < actor.config.vocab_size
    logits = np.asarray(full.logits)[..., :support]
    for i, p in enumerate(prompts):
        n = int(out.lengths[i])
        resp = out.tokens[i, :n]
        assert n == m or resp[-1] in eos
        assert not set(resp[:-1].tolist()) & eos
        pos = np.arange(len(p) - 1, len(p) - 1 + n)
        np.testing.assert_array_equal(resp, logits[i, pos].argmax(-1))
        logp = jax.nn.log_softmax(jnp.asarray(logits[i, pos]), axis=-1)
        np.testing.assert_allclose(out.logprobs[i, :n], np.asarray(logp)[np.arange(n), resp], atol=1e-4)
        # The fingerprint is the prompt's (read at the last prompt token, before the response).
        np.testing.assert_allclose(out.fingerprints[i], np.asarray(full.fingerprint)[i], atol=1e-5)
        # Oracle 2: Hugging Face greedy generate on the same checkpoint.
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=m,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=tok.pad_token_id,
                suppress_tokens=list(range(support, actor.config.vocab_size)),
            )
        np.testing.assert_array_equal(gen[0, len(p) :].numpy(), resp)


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from bipace_jax.models import Qwen2Actor, Qwen2Config
    from bipace_jax.sharding import make_mesh, shard_params
    from bipace_jax.sampling import Engine, SamplerConfig
    from tests.test_sampling import small_tokenizer

    tok = small_tokenizer()
    cfg = SamplerConfig(max_new_tokens=8, temperature=1.3, top_k=50, top_p=0.95, stop_strings=("</action>",),
                        batch_buckets=(8,), length_buckets=(16,))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(tok), size=int(rng.integers(1, 16))).tolist() for _ in range(6)]
    result = {"n_dev": len(jax.devices())}
    # One device (mesh=None: everything on device 0), then the mesh data=2 x fsdp=2 x tensor=2.
    actor = Qwen2Actor(Qwen2Config.tiny(vocab_size=len(tok)), rngs=nnx.Rngs(3))
    out = Engine(tok, cfg).generate(actor, prompts, jax.random.key(11))
    result["one"] = {k: np.asarray(v).tolist() for k, v in out._asdict().items() if k != "timing"}
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shard_params(actor, mesh)
    result["devices_per_param"] = len(actor.embed.embedding[...].sharding.device_set)
    out = Engine(tok, cfg, mesh=mesh).generate(actor, prompts, jax.random.key(11))
    result["eight"] = {k: np.asarray(v).tolist() for k, v in out._asdict().items() if k != "timing"}
    json.dump(result, sys.stdout)
""")


@pytest.mark.slow
def test_sharded_over_8_cpu_devices_equals_one_device():
    res = run_on_cpu_devices(_SHARDED_SCRIPT)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    one, eight = result["one"], result["eight"]
    assert result["n_dev"] == 8 and result["devices_per_param"] == 8
    np.testing.assert_array_equal(eight["tokens"], one["tokens"])
    np.testing.assert_array_equal(eight["lengths"], one["lengths"])
    np.testing.assert_allclose(eight["logprobs"], one["logprobs"], atol=1e-4)
    np.testing.assert_allclose(eight["fingerprints"], one["fingerprints"], atol=1e-4)
    assert len(set(map(tuple, one["tokens"]))) > 1  # rows really differ
