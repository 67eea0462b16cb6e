"""load_tokenizer / Tokenizer: encode, decode, special tokens, chat templates, errors."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import shared_tokenizer
from tokenizer_svc.tokenizer import load_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say 你好 and 👋"},
]


@pytest.fixture(scope="module")
def tok(trained_tokenizer_dir):
    return load_tokenizer(trained_tokenizer_dir)


def test_trained_tokenizer_properties(tok):
    assert tok.vocab_size == 1024
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>") == 2
    # <|im_start|> is special only through added_tokens_decoder; it must count all the same.
    assert tok.all_special_ids == {0, 1, 2}
    assert tok.model_max_length == 1024
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(0) == "<|endoftext|>"


@pytest.mark.parametrize("text", ["def f(x):\n    return x", "naïve café, 你好世界 👨‍👩‍👧 🇫🇷", ""])
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_special_tokens_only_when_asked(tok):
    ids = [1, *tok.encode("hi"), 2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_renders_chatml_and_encodes_without_extra_specials(tok):
    text = tok.render_chat(MESSAGES)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSay 你好 and 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.render_chat(MESSAGES, add_generation_prompt=False).endswith("👋<|im_end|>\n")
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3  # the markers are single special tokens


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([{"content": "hi"}], "no 'role'"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "user", "content": 3}], "'content' must be a string"),
        (["hi"], "expected a dict"),
        ([], "non-empty list"),
    ],
)
def test_bad_messages_raise_value_error(tok, messages, fragment):
    with pytest.raises(ValueError, match=fragment):
        tok.apply_chat_template(messages)


def test_model_without_chat_template_raises_value_error(trained_tokenizer_dir, tmp_path):
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(trained_tokenizer_dir / name, tmp_path / name)
    config = json.loads((trained_tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["qwen2", "llama3", "gpt2"])
def test_real_tokenizers_match_transformers(name):
    from transformers import AutoTokenizer

    path = shared_tokenizer(name)
    tok, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    text = "Hello, world! naïve café 你好世界 👨‍👩‍👧‍👦"
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == len(hf) > 50000
    assert tok.eos_token_id == hf.eos_token_id is not None
    assert tok.model_max_length is None  # these configs set transformers' "no limit" placeholder


def test_qwen2_chat_template_comes_from_chat_template_jinja():
    tok = load_tokenizer(shared_tokenizer("qwen2"))
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_gpt2_has_no_chat_template():
    tok = load_tokenizer(shared_tokenizer("gpt2"))
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_chat(MESSAGES)
