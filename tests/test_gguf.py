"""GGUF as a model format: files written here with the gguf package's writer (each tensor type,
each architecture) load, and the engine's greedy tokens equal those of transformers' own GGUF
loader on the same file; the tokenizer and chat template come from the metadata; bad files get
errors that name the problem."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants
from transformers import AutoModelForCausalLM

from engine_svc import LLM, SamplingParams
from engine_svc.models.gguf_checkpoint import GGUFCheckpoint
from engine_svc.models.spec import ModelSpec
from kernels.cpu.native_gemm import amx_bf16_reference
from tests.engine_helpers import (
    assert_greedy_matches,
    hf_greedy,
    make_engine,
    random_model,
    random_prompts,
    run_to_completion,
)
from tests.gguf_files import ALL_TYPES, K_TYPES, gguf_name, rewrite_gguf, write_gguf

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2)
# K-quant blocks hold 256 values: every weight's input dimension must be a multiple of 256.
WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_key_value_heads=2)
ARCHS = {
    "llama": dict(num_attention_heads=4),
    "mistral": dict(num_attention_heads=8),
    "qwen2": dict(num_attention_heads=4),
    # transformers' GGUF config reader drops head_dim for qwen3 (it takes Qwen3Config's 128)
    "qwen3": dict(num_attention_heads=4, head_dim=128),
}


def _model(root, arch, tokenizer_dir, shape=SMALL, **extra):
    return random_model(root / f"hf-{arch}", tokenizer_dir, arch, seed=77, **shape, **ARCHS[arch], **extra)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("gguf_src")
    return {arch: _model(root, arch, trained_tokenizer_dir) for arch in ARCHS}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, trained_tokenizer_dir):
    return _model(tmp_path_factory.mktemp("gguf_wide"), "llama", trained_tokenizer_dir, WIDE)


def _hf_from_gguf(path):
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _engine_tokens(path, prompts, n, **options):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = make_engine(path, max_num_batched_tokens=24, dtype="float32", **options)
    out = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    return [out[(str(i), 0)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("type_name", ["F32", "Q8_0", "Q4_1"])
def test_greedy_tokens_equal_transformers_gguf_loader(hf_dirs, tmp_path, arch, type_name):
    path = write_gguf(hf_dirs[arch], tmp_path / f"{arch}-{type_name}.gguf", type_name)
    hf = _hf_from_gguf(path)
    prompts = random_prompts([5, 40], 1024, seed=3)  # 40 tokens: chunked at 24
    for prompt, got in zip(prompts, _engine_tokens(path, prompts, 12), strict=True):
        assert_greedy_matches(hf, prompt, got, hf_greedy(hf, prompt, 12))


def test_f32_file_equals_the_source_checkpoint(hf_dirs, tmp_path):
    """The permutation of q/k rows is undone exactly: an F32 GGUF gives the safetensors model's tokens."""
    path = write_gguf(hf_dirs["llama"], tmp_path / "llama.gguf", "F32")
    prompts = random_prompts([7, 33], 1024, seed=9)
    assert _engine_tokens(path, prompts, 16) == _engine_tokens(hf_dirs["llama"], prompts, 16)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_tensor_type_loads_as_gguf_dequantizes_it(wide_llama, tmp_path, type_name):
    """Each weight in the engine equals the gguf package's own dequantization of the file's blocks
    (an independent reader), in HF row order; and the engine agrees with transformers on tokens."""
    path = write_gguf(wide_llama, tmp_path / f"wide-{type_name}.gguf", type_name)
    llm = LLM(model=str(path), dtype="float32", linear_backend="dense", num_kv_blocks=64)
    layer = llm.engine.model.layers[0]
    reader = GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}

    def dequant(hf_name):
        t = raw[gguf_name(hf_name)]
        return torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    hf = _hf_from_gguf(path)
    hf_layer = hf.model.layers[0]
    # v and the MLP are not permuted: the engine's rows are the file's rows as they are
    q, k, v = (layer.qkv_weight[: 4 * 64], layer.qkv_weight[4 * 64 : 6 * 64], layer.qkv_weight[6 * 64 :])
    assert torch.equal(v, dequant("model.layers.0.self_attn.v_proj.weight"))
    assert torch.equal(layer.down_weight, dequant("model.layers.0.mlp.down_proj.weight"))
    assert torch.equal(llm.engine.model.embed, dequant("model.embed_tokens.weight"))
    # q and k were permuted by the writer; transformers un-permutes them with its own code
    assert torch.equal(q, hf_layer.self_attn.q_proj.weight)
    assert torch.equal(k, hf_layer.self_attn.k_proj.weight)
    assert torch.equal(layer.gate_up_weight[:512], hf_layer.mlp.gate_proj.weight)
    if type_name not in K_TYPES:  # random K blocks make a flat model: near-ties everywhere
        prompt = random_prompts([9], 1024, seed=4)[0]
        got = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
        assert_greedy_matches(hf, prompt, got[0].outputs[0].token_ids, hf_greedy(hf, prompt, 8))


def test_spec_from_metadata(hf_dirs, tmp_path):
    for arch in ARCHS:
        path = write_gguf(hf_dirs[arch], tmp_path / f"{arch}.gguf", "F32")
        from_gguf, from_hf = ModelSpec.from_path(path), ModelSpec.from_path(hf_dirs[arch])
        # llama.cpp converts Mistral as llama: the same decoder, so the same flags
        expected = "LlamaForCausalLM" if arch == "mistral" else from_hf.architecture
        assert from_gguf.architecture == expected
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            assert getattr(from_gguf, field) == getattr(from_hf, field), (arch, field)
        for field in ("num_heads", "num_kv_heads", "head_dim", "rope_theta", "qkv_bias", "qk_norm"):
            assert getattr(from_gguf, field) == getattr(from_hf, field), (arch, field)
        assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)
        assert from_gguf.eos_token_ids == (2,)
        # a directory holding one GGUF file is the same model
        d = tmp_path / f"dir-{arch}"
        d.mkdir()
        shutil.copy(path, d / path.name)
        assert ModelSpec.from_path(d) == from_gguf


def test_tied_embeddings(tmp_path, trained_tokenizer_dir):
    d = _model(tmp_path, "llama", trained_tokenizer_dir, tie_word_embeddings=True)
    path = write_gguf(d, tmp_path / "tied.gguf", "Q8_0")
    assert "output.weight" not in {t.name for t in GGUFReader(str(path)).tensors}
    assert ModelSpec.from_path(path).tie_word_embeddings
    hf = _hf_from_gguf(path)
    prompt = random_prompts([11], 1024, seed=5)[0]
    assert_greedy_matches(hf, prompt, _engine_tokens(path, [prompt], 10)[0], hf_greedy(hf, prompt, 10))


def test_tokenizer_and_chat_template_from_metadata(hf_dirs, tmp_path, trained_tokenizer_dir):
    """The tokenizer is transformers' conversion of the metadata, kept as converted (the cached copy
    encodes exactly as transformers' own GGUF tokenizer), with the source's vocabulary and template."""
    from transformers import AutoTokenizer

    from tokenizer_svc.tokenizer import load_tokenizer

    path = write_gguf(hf_dirs["qwen2"], tmp_path / "q.gguf", "F32")
    source, converted = load_tokenizer(trained_tokenizer_dir), load_tokenizer(path)
    again = load_tokenizer(path)  # from the cache this time
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert converted.backend.get_vocab() == source.backend.get_vocab()
    for text in ["Hello, world!", "def f(x):\n    return x * 2  # héllo 你好 12345", "<|im_start|>user"]:
        assert converted.encode(text) == reference(text)["input_ids"] == again.encode(text), text
        assert converted.decode(converted.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert converted.render_chat(messages) == source.render_chat(messages)
    assert converted.eos_token_id == 2
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == converted.apply_chat_template(messages)
    assert out[0].prompt == source.render_chat(messages)
    assert len(out[0].outputs[0].token_ids) == 4


# --- the metadata reader ----------------------------------------------------------------------


def _same_fields(ours, stock) -> None:
    assert list(ours.fields) == list(stock.fields)
    for key, b in stock.fields.items():
        a = ours.fields[key]
        assert (a.name, a.offset, a.types) == (b.name, b.offset, b.types), key
        assert len(a.parts) == len(b.parts) and list(a.data) == list(b.data), key
        assert a.contents() == b.contents(), key
        for i in (0, 1, -1, len(b.data) // 2) if len(b.data) > 1 else ():
            assert a.contents(i) == b.contents(i), (key, i)
            assert np.array_equal(a.parts[b.data[i]], b.parts[b.data[i]]), (key, i)
        assert a.contents(slice(2, 7)) == b.contents(slice(2, 7)), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in stock.tensors
    ]


def test_the_metadata_reads_as_the_gguf_packages_reader(wide_llama, tmp_path):
    """Every field (the tokenizer's string arrays, arrays of each scalar type, an empty and a nested
    array) as the gguf package's own reader gives it, though its array elements are made on access."""
    import gguf

    from engine_svc.models.gguf_checkpoint import _ValidatingReader
    from engine_svc.models.gguf_metadata import CompactReader

    path = _wide_file(wide_llama, tmp_path)
    _same_fields(_ValidatingReader(str(path)), GGUFReader(str(path)))
    w = gguf.GGUFWriter(str(tmp_path / "arrays.gguf"), "llama")
    for t, values in {
        gguf.GGUFValueType.UINT8: [0, 7, 255],
        gguf.GGUFValueType.INT16: [-3, 4],
        gguf.GGUFValueType.INT32: [-(2**31), 5, 2**31 - 1],
        gguf.GGUFValueType.UINT64: [2**63, 1],
        gguf.GGUFValueType.FLOAT32: [0.5, -1.25, 3.0],
        gguf.GGUFValueType.FLOAT64: [1e300, -2.5],
        gguf.GGUFValueType.BOOL: [True, False, True],
    }.items():
        w.add_key_value(f"test.{t.name.lower()}", values, gguf.GGUFValueType.ARRAY, sub_type=t)
    w.add_array("test.strings", ["", "a", "\u00e9t\u00e9", "x" * 300])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for reader in (_ValidatingReader, CompactReader):  # the engine's, and the gateway's (FIM ids)
        _same_fields(reader(str(tmp_path / "arrays.gguf")), GGUFReader(str(tmp_path / "arrays.gguf")))


def test_reading_a_large_vocabularys_metadata_makes_no_object_a_string():
    """The default model's 49,152 tokens and 48,900 merges: the package's reader makes two numpy
    arrays a string (150 MiB of Python objects at its peak, freed again but leaving the
    interpreter's arenas behind); ours reads their offsets only."""
    import tracemalloc

    from engine_svc.models.gguf_checkpoint import _ValidatingReader
    from engine_svc.models.model_path import resolve_model_path

    gguf_path = resolve_model_path("models/default").gguf
    tracemalloc.start()
    try:
        reader = _ValidatingReader(str(gguf_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 49152 and isinstance(tokens.contents(100), str)
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB"


# --- bad files -------------------------------------------------------------------------------


def _wide_file(wide_llama, tmp_path, type_name="Q8_0"):
    return write_gguf(wide_llama, tmp_path / f"bad-{type_name}.gguf", type_name)


def test_truncated_file_names_the_tensor(wide_llama, tmp_path):
    path = _wide_file(wide_llama, tmp_path)
    last = GGUFReader(str(path)).tensors[-1]
    data = path.read_bytes()
    path.write_bytes(data[: last.data_offset + 10])
    with pytest.raises(ValueError, match=rf"tensor {last.name} is truncated"):
        ModelSpec.from_path(path)


def test_file_cut_inside_the_header(wide_llama, tmp_path):
    path = _wide_file(wide_llama, tmp_path)
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ValueError, match="not readable"):
        ModelSpec.from_path(path)


def _patch_type(path, tensor_name: str, code: int) -> None:
    """Overwrite the type code in ``tensor_name``'s info record (name, n_dims, dims, type, offset)."""
    data = bytearray(path.read_bytes())
    key = tensor_name.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, code)
    path.write_bytes(bytes(data))


def test_unknown_tensor_type_names_the_tensor(wide_llama, tmp_path):
    path = _wide_file(wide_llama, tmp_path)
    _patch_type(path, "blk.0.ffn_up.weight", 250)
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_up\.weight has unknown GGML type code 250"):
        ModelSpec.from_path(path)


def test_unsupported_tensor_type_names_it_and_the_supported_ones(wide_llama, tmp_path):
    from gguf import GGMLQuantizationType

    path = _wide_file(wide_llama, tmp_path, "F32")
    _patch_type(path, "blk.0.attn_norm.weight", int(GGMLQuantizationType.I32))  # same size, not a weight type
    with pytest.raises(ValueError, match=r"blk\.0\.attn_norm\.weight has type I32; supported types: F32"):
        ModelSpec.from_path(path)


def test_mismatched_shape_names_the_tensor(hf_dirs, tmp_path):
    src = write_gguf(hf_dirs["llama"], tmp_path / "ok.gguf", "F32")
    out = rewrite_gguf(  # one weight 8 columns short
        src,
        tmp_path / "wrong-shape.gguf",
        tensor=lambda name, a: a[:, :-8] if name == "blk.1.ffn_down.weight" else a,
    )
    with pytest.raises(
        ValueError,
        match=r"GGUF tensor blk\.1\.ffn_down\.weight \(F32\): shape \(64, 120\), "
        r"the config needs \(64, 128\)",
    ):
        LLM(model=str(out), dtype="float32", num_kv_blocks=16)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    from gguf import GGUFWriter

    out = tmp_path / "falcon.gguf"
    w = GGUFWriter(str(out), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from engine_svc.models import arch as archs

    supported = ", ".join(archs.gguf_names())  # every declared one (engine_svc/models/arch/)
    assert len(archs.gguf_names()) > 5 and "falcon" not in archs.gguf_names()
    with pytest.raises(ValueError, match=rf"architecture 'falcon'; supported: {supported}$"):
        ModelSpec.from_path(out)


def test_directory_paths(hf_dirs, tmp_path):
    d = tmp_path / "two"
    d.mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_gguf(hf_dirs["llama"], d / name, "F32")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\); name one"):
        ModelSpec.from_path(d)
    assert ModelSpec.from_path(d / "a.gguf").num_layers == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json or .gguf file"):
        ModelSpec.from_path(empty)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        ModelSpec.from_path(tmp_path / "weights.bin")


def test_rope_freq_factors_from_the_file(hf_dirs, tmp_path):
    """Llama 3.1 scaling travels in GGUF as a rope_freqs tensor: the spec divides by it."""

    from kernels.reference.rotary import rope_inv_freq

    factors = np.linspace(1.0, 8.0, 8, dtype=np.float32)  # head_dim 16 -> 8 frequencies
    src = write_gguf(hf_dirs["llama"], tmp_path / "ok.gguf", "F32")
    out = rewrite_gguf(src, tmp_path / "rope.gguf", add=lambda w: w.add_tensor("rope_freqs.weight", factors))
    spec = ModelSpec.from_path(out)
    plain = rope_inv_freq(spec.head_dim, spec.rope_theta)
    assert torch.allclose(
        rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling), plain / torch.tensor(factors)
    )
    assert GGUFCheckpoint(out).config()["rope_scaling"]["rope_type"] == "freq_factors"


def test_the_service_serves_a_gguf_file(hf_dirs, tmp_path):
    """`llmserve serve --model x.gguf`: gateway, tokenizer worker and engine all read the one file;
    a chat over gRPC gives the offline LLM.chat's tokens on the same file."""
    from gateway.client import LLMServeClient
    from tests.service_process import ServiceProcess

    path = write_gguf(hf_dirs["llama"], tmp_path / "served.gguf", "Q8_0")
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = LLM(model=str(path), dtype="float32", num_kv_blocks=64).chat(messages, params, use_tqdm=False)[
        0
    ]
    with ServiceProcess(path, "--num-kv-blocks", "64", "--tokenizer-workers", "1") as sp:
        with LLMServeClient(sp.target, timeout=60) as client:
            info = client.model_info()
            assert info.has_chat_template
            reply = client.generate(
                messages=messages, max_tokens=12, temperature=0.0, ignore_eos=True, return_token_ids=True
            )
    assert list(reply.token_ids) == offline.outputs[0].token_ids
    assert reply.text == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_sentencepiece_style_vocabulary(hf_dirs, tmp_path):
    """A `tokenizer.ggml.model = llama` vocabulary (pieces with scores, byte fallback tokens), as
    Llama 2 / Mistral GGUFs carry it: whole words come out as their pieces, unknown characters as
    bytes, and the text decodes back."""

    from tokenizer_svc.tokenizer import load_tokenizer

    # every prefix of the two words is a piece, so each word has a path of merges to itself
    prefixes = ["\u2581" + w[:i] for w in ("hello", "world") for i in range(1, 6)]
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", *prefixes]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [float(len(p)) for p in pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    extra = 1024 - len(tokens)

    def vocabulary(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens + [f"<extra_{i}>" for i in range(extra)])
        w.add_token_scores(scores + [-1000.0] * extra)
        w.add_token_types(types + [4] * extra)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    src = write_gguf(hf_dirs["llama"], tmp_path / "bpe.gguf", "F32")
    out = rewrite_gguf(
        src, tmp_path / "spm.gguf", drop_keys=("tokenizer.", "llama.vocab_size"), add=vocabulary
    )
    tok = load_tokenizer(out)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["\u2581hello", "\u2581world"]
    assert tok.decode(ids) == "hello world"
    odd = tok.encode("hello é", add_special_tokens=False)  # é is not a piece: its UTF-8 bytes
    assert tok.convert_ids_to_tokens(odd)[-2:] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(odd) == "hello é"
    assert tok.eos_token_id == 2 and ModelSpec.from_path(out).eos_token_ids == (2,)


@pytest.mark.parametrize(
    "type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
)
def test_k_quant_blocks_are_served_bit_equal_to_the_dequantized_path(wide_llama, tmp_path, type_name):
    """A K-quant (or Q5_0, Q5_1, IQ4_NL, IQ4_XS) file's blocks run on the quantized GEMM (auto), bit-equal
    to the fp32 GEMM on the gguf package's dequantization of them (``quantization="none"``: the
    loader dequantizes with it)."""
    path = write_gguf(wide_llama, tmp_path / f"wide-{type_name}.gguf", type_name)
    blocks = make_engine(path, num_kv_blocks=64, quantized_activations="none")  # the exact path
    floats = make_engine(path, num_kv_blocks=64, quantization="none")
    for layer in blocks.model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert getattr(layer, name).fmt == type_name, name
    for a, b in zip(blocks.model.layers, floats.model.layers, strict=True):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            inp = torch.randn(9, getattr(a, name).in_features)
            assert torch.equal(getattr(a, name)(inp), getattr(b, name)(inp)), name
    x = torch.randn(5, blocks.spec.hidden_size)
    assert torch.equal(blocks.model.compute_logits(x), floats.model.compute_logits(x))


def test_the_load_log_names_each_tensor_left_without_a_kernel(wide_llama, tmp_path, caplog):
    """A mixed file: the tensors no kernel runs as they are are named in the log, each with its type
    (here an F16 part of a fused projection whose other parts are Q8_0); those served from their
    blocks, and an F16 projection of its own (the native GEMM's 16-bit panels), are not reported as
    dequantized."""
    import logging

    f16 = {"blk.0.attn_q.weight": "F16", "blk.0.attn_output.weight": "F16"}
    path = write_gguf(wide_llama, tmp_path / "mixed.gguf", "Q8_0", types=f16)
    with caplog.at_level(logging.INFO, logger="engine_svc.models.quantized_weights"):
        engine = make_engine(path, num_kv_blocks=16)
    dequantized = [r.getMessage() for r in caplog.records if "dequantized, no kernel" in r.getMessage()]
    assert [m.split()[1] for m in dequantized] == ["blk.0.attn_q.weight"], dequantized
    assert all("(F16 " in m for m in dequantized), dequantized
    layer = engine.model.layers[0]
    assert layer.o_proj.packed.dtype == torch.float16 and layer.qkv_proj.packed.dtype == torch.float32


def test_the_load_reads_one_linears_blocks_at_a_time(wide_llama, tmp_path, monkeypatch):
    """The file's blocks are read into the kernels' form (a byte a weight plus fp32 scales: larger
    than the file) one linear at a time, while it is packed, never all at once (a 1 GiB Q4_K_M file
    peaked at 7.2 GiB when every tensor was read up front); and none stays read after the load."""
    from engine_svc.models import quantized_weights as qw

    live, most, made = set(), [0], []
    materialize, release = qw.LazyBlocks.materialize, qw.LazyBlocks.release

    def counting_materialize(self):
        live.add(id(self))
        made.append(self)
        most[0] = max(most[0], len(live))
        return materialize(self)

    def counting_release(self):
        live.discard(id(self))
        release(self)

    monkeypatch.setattr(qw.LazyBlocks, "materialize", counting_materialize)
    monkeypatch.setattr(qw.LazyBlocks, "release", counting_release)
    path = write_gguf(wide_llama, tmp_path / "wide-Q4_K.gguf", "Q4_K")
    engine = make_engine(path, num_kv_blocks=16)
    layers = len(engine.model.layers)
    assert len({id(b) for b in made}) >= 4 * layers  # every projection was packed from its blocks
    assert most[0] <= 2, most  # one linear's (and at most the tied embedding's lookup) at a time
    assert all(b._read is None for b in made if id(b) not in live)


@pytest.mark.parametrize("tied", [False, True])
def test_the_embedding_table_is_never_dequantized_when_its_blocks_serve_the_lookup(
    tmp_path, trained_tokenizer_dir, monkeypatch, tied
):
    """The lookup reads the file's blocks (and a tied table is the LM head's blocks too), so the load
    never dequantizes the table to fp32 (Qwen2.5-Coder-1.5B's: 890 MiB, assigned through a second
    copy: the load's peak 4.7 -> 3.7 GiB; Gemma 3 270M's tied Q8_0 table 2.8 -> 1.3 GiB), and its
    rows are the table the float load reads from the same file, bit for bit."""
    from engine_svc.models import gguf_checkpoint

    d = _model(tmp_path, "llama", trained_tokenizer_dir, WIDE, tie_word_embeddings=tied)
    path = write_gguf(d, tmp_path / f"embed-{tied}.gguf", "Q4_K")
    dequantized, dequantize = [], gguf_checkpoint.GGUFTensor.dequantize

    def recording(self):
        dequantized.append(self.gguf_name)
        return dequantize(self)

    monkeypatch.setattr(gguf_checkpoint.GGUFTensor, "dequantize", recording)
    engine = make_engine(path, num_kv_blocks=16)
    assert "token_embd.weight" not in dequantized, dequantized
    assert "blk.0.attn_q.weight" not in dequantized  # (the recording sees the load's reads)
    lookup = engine.model.embed_blocks
    assert lookup is not None and lookup.reads_the_file and engine.model.embed.numel() == 0
    floats = make_engine(path, num_kv_blocks=16, quantization="none")
    assert "token_embd.weight" in dequantized
    table = floats.model.embed.data
    ids = torch.arange(table.shape[0])
    assert torch.equal(lookup(ids).view(torch.int32), table.view(torch.int32))


def b_weight_bits(floats_linear, dtype) -> np.ndarray:
    """The [out, in] weight of an fp32 native linear, read back from its panels (panel p holds
    columns p * NB .. as K rows of NB values), as ``dtype``'s 16-bit patterns (exact: the file's
    16-bit values dequantized)."""
    from kernels.cpu import native_gemm

    nb = native_gemm.library().llmserve_gemm_panel_width()
    k, n = floats_linear.in_features, floats_linear.out_features
    w = floats_linear.packed.view(-1, k, nb).permute(0, 2, 1).reshape(-1, k)[:n]
    assert torch.equal(w.to(dtype).float(), w)
    return w.to(dtype).contiguous().view(torch.int16).numpy().view("uint16")


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_16_bit_float_files_run_on_the_native_gemm_as_stored(hf_dirs, tmp_path, type_name):
    """An F16 / BF16 file's linears keep the file's 16-bit values in the native GEMM's panels (no
    fp32 copy), bit-equal to the fp32 GEMM on the same file dequantized (``quantization="none"``),
    and the greedy tokens are transformers' on the file."""
    path = write_gguf(hf_dirs["llama"], tmp_path / f"llama-{type_name}.gguf", type_name)
    half = make_engine(path, num_kv_blocks=64, dtype=None)
    floats = make_engine(path, num_kv_blocks=64, quantization="none")
    want = {"F16": torch.float16, "BF16": torch.bfloat16}[type_name]
    for a, b in zip(half.model.layers, floats.model.layers, strict=True):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert getattr(a, name).packed.dtype == want, name
            assert getattr(b, name).packed.dtype == torch.float32, name
            inp = torch.randn(7, getattr(a, name).in_features)
            if getattr(a, name).amx:  # bf16 on AMX-BF16 tiles (where granted): their own statement
                lin = getattr(a, name)
                wbits = b_weight_bits(getattr(b, name), want)
                bias = None if lin.bias is None else lin.bias.numpy()
                expect = torch.from_numpy(amx_bf16_reference(inp.numpy(), wbits, bias))
                assert torch.equal(lin(inp), expect), name
            else:
                assert torch.equal(getattr(a, name)(inp), getattr(b, name)(inp)), name
    hf = _hf_from_gguf(path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts([5, 40], 1024, seed=31)
    out = run_to_completion(half, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert_greedy_matches(hf, p, out[(str(i), 0)], hf_greedy(hf, p, 8))
