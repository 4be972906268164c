"""The embedded default's tokenizer: exact round trips, whole item-name tokens, chat template."""

import pytest

from bipace_jax.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, item_names, tiny_actor_config, train_tokenizer

CORPUS = [
    "craft 4 oak planks using 1 oak log",
    "craft 1 stone pickaxe using 3 cobblestone, 2 stick",
    "Goal: craft stone pickaxe.",
    "Got 3 cobblestone",
    "Crafted 1 minecraft:stone_pickaxe",
    "Inventory: [cobblestone] (3) [stick] (2) ",
] * 40
NAMES = ["oak planks", "oak log", "stone", "stone pickaxe", "cobblestone", "stick"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=300, phrase_tokens=NAMES)


def test_special_tokens_take_the_first_ids_and_eos_is_im_end(tok):
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.bos_token is None


@pytest.mark.parametrize(
    "text",
    [
        "<action>get 3 cobblestone</action>",
        "craft 1 stone pickaxe using 3 cobblestone, 2 stick\nstonecutter  [stone] (4)",
        "unicode ✓ ünïcödé\ttabs and   spaces <think>x</think>",
        "",
    ],
)
def test_encode_decode_round_trip_is_exact(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    if text.isascii():  # token by token (the sampler's stop check); multi-byte chars span tokens
        assert "".join(tok.decode([i]) for i in ids) == text


def test_item_names_and_tags_are_single_tokens_wherever_they_appear(tok):
    def pieces(text):
        return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])

    assert "stone pickaxe" in pieces("craft 1 stone pickaxe using 3 cobblestone")  # longest match wins
    assert "cobblestone" in pieces("Inventory: [cobblestone] (3)")  # same token in the inventory
    assert pieces("<action>get 2 stick</action>")[0] == "<action>"
    assert pieces("<action>get 2 stick</action>")[-2:] == ["stick", "</action>"]


def test_chat_template_is_chatml_without_a_default_system_prompt(tok):
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_sys = [{"role": "system", "content": "S"}] + msgs
    assert tok.apply_chat_template(with_sys, tokenize=False).startswith("<|im_start|>system\nS<|im_end|>\n")
    assert tok.chat_template == CHAT_TEMPLATE


def test_saved_folder_reloads_with_the_same_tokens_and_template(tok, tmp_path):
    from bipace_jax.models import load_tokenizer

    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    text = "Goal: craft stone pickaxe.\n<action>craft 1 stone pickaxe using 3 cobblestone, 2 stick</action>"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.chat_template == CHAT_TEMPLATE and len(again) == len(tok)


def test_bad_arguments_raise_naming_the_field():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="distinct"):
        train_tokenizer(CORPUS, vocab_size=300, phrase_tokens=["a", "a"])
    with pytest.raises(ValueError, match="hidden_size"):
        tiny_actor_config(100, eos_token_id=2, hidden_size=100, num_attention_heads=3)


def test_item_names_reads_outputs_and_ingredients_of_recipe_lines_only():
    lines = [
        "craft 4 oak planks using 1 oak log",
        "craft 1 stone pickaxe using 3 cobblestone, 2 stick",
        "Goal: craft x.",
        "Got 3 sand",
    ]
    assert item_names(lines) == ["cobblestone", "oak log", "oak planks", "stick", "stone pickaxe"]
