"""The shipped warm start (bipace_jax/data/textcraft_tiny): loads, is small, and still plays.

The quality check replays the first 16 games of the fixed validation panel (configs.textcraft_tasks)
through the RL loop's own sampler (greedy) and rollout, and requires the success rate recorded in the folder's sft_report.json minus
two games, and at least one win: a corrupted, random or format-mismatched checkpoint fails it (a
random actor wins none).
"""

import json
import os

import pytest

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "bipace_jax", "data", "textcraft_tiny")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.path.exists(os.path.join(SHIPPED, "config.json")), reason="no shipped warm start in this checkout"
    ),
]

# Greedy success on the first NUM_GAMES seen-goal games of the panel, measured when the checkpoint
# was made (see docs/warm_start.md / the folder's sft_report.json); the test allows MARGIN below it.
NUM_GAMES = 16
MARGIN = 0.125  # two games: batch-size-dependent float differences may flip a greedy choice


def test_shipped_folder_is_small_and_complete():
    files = os.listdir(SHIPPED)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert f in files, f
    size = sum(os.path.getsize(os.path.join(SHIPPED, f)) for f in files)
    assert size < 12 * 2**20, f"shipped warm start is {size / 2**20:.1f} MiB"


def test_shipped_checkpoint_loads_with_its_tokenizer_and_chat_template():
    from bipace_jax.models import load_hf_checkpoint, load_tokenizer
    from bipace_jax.tiny import CHAT_TEMPLATE

    actor = load_hf_checkpoint(SHIPPED)
    tok = load_tokenizer(os.path.join(SHIPPED, "tokenizer"))
    assert actor.config.vocab_size == len(tok)
    # the tokenizer as trained: " 1" is one token (Qwen2Tokenizer's pre-tokenizer would split it)
    assert tok.convert_ids_to_tokens(tok("craft 1 stick")["input_ids"])[:2] == ["craft", "\u01201"]
    assert tok.chat_template == CHAT_TEMPLATE
    assert actor.config.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_checkpoint_folder_itself_loads_the_trained_tokenizer_despite_its_qwen2_config():
    # config.json says model_type qwen2; AutoTokenizer alone would swap in Qwen2's pre-tokenizer
    # (" 1" -> " ", "1"). load_tokenizer keeps the folder's generic tokenizers backend as trained.
    from bipace_jax.models import load_tokenizer

    top = load_tokenizer(SHIPPED)
    sub = load_tokenizer(os.path.join(SHIPPED, "tokenizer"))
    text = "get 3 oak logs\n<action>craft 1 stick using 2 oak planks</action>"
    assert top(text)["input_ids"] == sub(text)["input_ids"]
    assert top.convert_ids_to_tokens(top("craft 1 stick")["input_ids"])[:2] == ["craft", "\u01201"]
    assert top.chat_template == sub.chat_template


def test_shipped_warm_start_still_solves_validation_games():
    import jax

    import environments
    from bipace_jax.config import resolve_template, system_prompt_of
    from bipace_jax.models import load_hf_checkpoint, load_tokenizer
    from bipace_jax.rollout import RolloutConfig, collect
    from bipace_jax.sampling import Engine, SamplerConfig
    from configs import textcraft_tasks as tasks
    from environments.pool import EnvPool

    report = json.load(open(os.path.join(SHIPPED, "sft_report.json")))
    first = report["greedy_first_games"]  # the shipped report predates RL's record keys (val/success_rate)
    expected = first.get("val/success_rate", first.get("success"))
    actor = load_hf_checkpoint(SHIPPED)
    tok = load_tokenizer(os.path.join(SHIPPED, "tokenizer"))
    train_ids, held = tasks.split(environments.make(tasks.GAME, max_steps=tasks.MAX_STEPS))
    panel = tasks.validation_panel(train_ids, held)[:NUM_GAMES]
    sampler = Engine(
        tok,
        SamplerConfig(max_new_tokens=32, greedy=True, batch_buckets=(NUM_GAMES,), length_buckets=(224, 288, 384, 448)),
    )
    rcfg = RolloutConfig(
        game=tasks.GAME,
        group_size=1,
        max_steps=tasks.MAX_STEPS,
        history_length=tasks.HISTORY_LENGTH,
        max_prompt_length=448,
        fallback_action=tasks.FALLBACK_ACTION,
        show_inventory=tasks.SHOW_INVENTORY,
        system_prompt=system_prompt_of(tasks.SYSTEM_PROMPT),
        template=resolve_template("configs.textcraft_tasks:TEMPLATE"),
    )
    with EnvPool(tasks.GAME, NUM_GAMES, env_options={"max_steps": tasks.MAX_STEPS}, num_workers=2) as pool:
        res = collect(actor, sampler, pool, panel, rcfg, jax.random.key(0))
    s = res.stats.values()
    # at least one win (a random or corrupted actor wins none) and near the recorded rate
    assert s["success_rate"] >= max(expected - MARGIN, 1 / NUM_GAMES), (s, expected)
    assert s["invalid_rate"] < 0.1, s
