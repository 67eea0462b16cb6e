"""The built-in default model: deterministic, and loadable by transformers."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_svc.models.build_default import build_default_model


def test_default_model_build_is_deterministic(default_model_dir, tmp_path):
    again = build_default_model(tmp_path / "again")
    first = (default_model_dir / "SHA256SUMS").read_text()
    assert first == (again / "SHA256SUMS").read_text()
    assert "model.safetensors" in first and "tokenizer.json" in first


def test_transformers_loads_default_model_and_tokenizer(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert len(tok) == 8192
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(special) < 3
    text = "def main():\n    print('héllo 你好 😀')"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert model.config.model_type == "llama"
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("hello")])).logits
    assert logits.shape[-1] == 8192 and torch.isfinite(logits).all()
