"""benchmarks/quantization_quality.py: the figures llama.cpp's ``perplexity --kl-divergence``
reports, on the positions it scores. KL and top-1 checked on distributions whose values are known
by hand; the scored rows checked against transformers' own forward on the same weights (so an
off-by-one between a row and the token it predicts fails); the English windows come from the
interpreter's documentation; the F32 copy of a quantized file holds its dequantized values."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM

from benchmarks import quantization_quality as qq
from benchmarks.requantize_gguf import requantize
from engine_svc.llm import LLM
from tests.gguf_files import write_gguf


def test_scored_positions_are_the_second_half_like_llama_cpp():
    window = list(range(100, 110))
    assert qq.first_scored(window) == 5
    # positions 5..8 predict tokens 6..9: n_ctx/2 - 1 of them, as llama.cpp's perplexity scores
    assert qq.targets(window).tolist() == [106, 107, 108, 109]


def test_compare_on_known_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.7, 0.2, 0.1]]).log()
    q = torch.tensor([[0.25, 0.75, 0.0], [0.7, 0.2, 0.1]]).log()
    window = [0, 0, 0, 1, 0]  # first scored 2: positions 2, 3 predict tokens 1, 0
    same = qq.compare([p], [p], [window])
    assert same["mean_kl"] == 0 and same["max_kl"] == 0 and same["top1_agreement"] == 1
    assert same["positions"] == 2
    got = qq.compare([p], [q], [window])
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert got["mean_kl"] == pytest.approx(kl0 / 2, rel=1e-6)
    assert got["max_kl"] == pytest.approx(kl0, rel=1e-6)
    assert got["top1_agreement"] == 0.5  # row 0: argmax 0 against 1; row 1 equal
    assert got["perplexity"] == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.7)) / 2), rel=1e-6)
    assert got["reference_perplexity"] == pytest.approx(
        math.exp(-(math.log(0.5) + math.log(0.7)) / 2), rel=1e-6
    )


def test_english_windows_are_the_stdlib_docs(trained_tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(trained_tokenizer_dir / "tokenizer.json"))
    windows = qq.text_windows(tok, "english", 64, 3)
    assert [len(w) for w in windows] == [64, 64, 64]
    import pydoc_data.topics

    first = next(iter(pydoc_data.topics.topics.values()))
    assert tok.decode(windows[0]).replace(" ", "")[:40] == first.replace(" ", "")[:40]


def test_scored_rows_are_transformers_next_token_distributions(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    window = torch.randint(3, 1024, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(tiny_llama), dtype="float32", max_logprobs=1024, max_num_seqs=1, num_kv_blocks=64)
    (rows,) = qq.our_logprobs(llm, [window], 1024)
    llm.shutdown()
    with torch.no_grad():
        want = hf(torch.tensor([window])).logits[0].log_softmax(-1)
    first = qq.first_scored(window)
    assert rows.shape == (len(window) - 1 - first, 1024)
    torch.testing.assert_close(rows, want[first : len(window) - 1], atol=2e-4, rtol=0)


def test_f32_copy_holds_the_dequantized_values(tmp_path, tiny_llama):
    d = tmp_path / "hf"
    shutil.copytree(tiny_llama, d)
    (tmp_path / "src").mkdir()
    src = write_gguf(d, tmp_path / "src" / "model.Q4_1.gguf", "Q4_1")
    out = requantize(src, "F32", tmp_path / "out" / "model.F32.gguf")
    by_name = {t.name: t for t in GGUFReader(str(out)).tensors}
    rewritten = 0
    for t in GGUFReader(str(src)).tensors:
        new = by_name[t.name]
        assert new.tensor_type == GGMLQuantizationType.F32, t.name
        want = dequantize(np.array(t.data), t.tensor_type)
        assert np.array_equal(np.array(new.data).reshape(want.shape), want), t.name
        rewritten += t.tensor_type != GGMLQuantizationType.F32
    assert rewritten >= 7  # the linears were Q4_1 blocks, now their exact values


def test_unknown_paths_and_texts_are_refused():
    with pytest.raises(SystemExit):
        qq.main(["--paths", "gguf-int4"])
    with pytest.raises(SystemExit):
        qq.main(["--texts", "french"])


def test_fp32_kinds_put_those_linears_back_on_fp32_activations(tiny_llama, tmp_path):
    from tests.engine_helpers import make_engine

    path = write_gguf(tiny_llama, tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    e = make_engine(path, quantized_activations="int8")
    exact = make_engine(path, quantized_activations="none")
    m = e.model
    x = torch.randn(3, e.spec.hidden_size)
    int8_logits = m.compute_logits(x)
    assert not torch.equal(int8_logits, exact.model.compute_logits(x))  # int8 activations differ
    # The load freed the float weights and the packed blocks: the blocks are read from the file again.
    assert qq.put_on_fp32_activations(m, path, ("lm_head",)) == "fp32 activations: 1 x Q8_0 lm_head"
    assert type(m.lm_head_proj).__name__ == "QuantLinear"
    assert {type(layer.qkv_proj).__name__ for layer in m.layers} == {"Int8ActLinear"}
    assert torch.equal(m.compute_logits(x), exact.model.compute_logits(x))  # the exact head
    assert "2 x Q8_0 down" in qq.put_on_fp32_activations(m, path, ("down",))
    assert {type(layer.down_proj).__name__ for layer in m.layers} == {"QuantLinear"}
    with pytest.raises(ValueError, match="unknown"):
        qq.put_on_fp32_activations(m, path, ("attention",))
