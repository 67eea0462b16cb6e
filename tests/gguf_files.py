"""GGUF files for tests, written with the ``gguf`` package's own writer the way llama.cpp's
converter lays them out: its tensor names, dimensions in reverse, and the Llama family's q/k rows
permuted for its rotary layout. The engine's reader undoes all of that; transformers' GGUF loader
(an independent reader) undoes it too, so the two must agree on every file written here.

``gguf.quants`` can quantize F16, BF16, Q8_0 and Q4/Q5 blocks; the K-quant types (Q2_K..Q6_K) have
no quantizer there, so their blocks are random bytes with finite, small scale fields: any bit
pattern of the packed quants is a valid block.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file

FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES + K_TYPES

# byte offsets of the fp16 scale fields in one 256-value K-quant block (ggml-common.h layouts)
# IQ4_NL, IQ4_XS: no quantizer in the gguf package either; random nibbles (and IQ4_XS's 6-bit
# sub-block scales), a sane fp16 scale
_K_SCALE_FIELDS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}

_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma2": "gemma2",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp writes Mixtral as llama with expert_count
    "smollm3": "smollm3",  # Llama's tensors; the NoPE layers are llama.cpp's fixed every-fourth
}
# Routed experts: each expert's HF tensor -> GGUF's stacked tensor of every expert ([E, rows, cols])
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = {
    "gate_proj": "ffn_gate_exps",
    "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps",
}
_STACKED |= {"down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_GEMMA = ("gemma2", "gemma3")
# Gemma 3's names where they differ from the Llama family's (llama.cpp's converter)
_GEMMA3_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3's fused projections (llama.cpp's converter keeps them fused, rows as HF has them)
_PHI3_NAMES = {
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str, g_arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    if rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):  # a routed-experts layer's router
        return f"blk.{index}.ffn_gate_inp.weight"
    names = {**_NAMES, **_GEMMA3_NAMES} if g_arch in _GEMMA else _NAMES
    if g_arch == "phi3":
        names = {**_NAMES, **_PHI3_NAMES}
    return f"blk.{index}.{names[rest]}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows: per head, the two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, type_name: str, seed: int) -> np.ndarray:
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_FIELDS[type_name]:
        scale = rng.uniform(0.002, 0.01, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def write_gguf(
    model_dir: Path, out: Path, type_name: str = "F32", arch: str | None = None, types: dict | None = None
) -> Path:
    """The HF model in ``model_dir`` (random weights, its tokenizer.json) as one GGUF file whose 2-D
    weights are of ``type_name`` (norms and biases stay F32, as llama.cpp keeps them); ``types``:
    GGUF tensor name (``blk.0.attn_q.weight``) -> its own type, for a file of mixed formats."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    g_arch = _GGUF_ARCH[arch]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = GGUFWriter(str(out), g_arch)
    w.add_name(f"test {arch} {type_name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base (the local one is 10k)
    w.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 1e4))))
    if g_arch in _GEMMA:
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    _add_long_rope(w, cfg, head_dim)
    if g_arch not in _GEMMA and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        w.add_sliding_window(cfg["sliding_window"])  # (Mixtral's, served on every layer)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, model_dir, cfg)
    weights = load_file(str(model_dir / "model.safetensors"))
    permuted = g_arch in ("llama", "smollm3")
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name in [n for n in weights if _EXPERT.match(n)]:
        layer, expert, proj = _EXPERT.match(name).groups()
        stacked.setdefault(f"blk.{layer}.{_STACKED[proj]}.weight", {})[int(expert)] = weights.pop(name)
    for i, (g_name, by_expert) in enumerate(sorted(stacked.items())):
        array = np.stack([by_expert[e] for e in sorted(by_expert)]).astype(np.float32)
        _add_tensor(w, g_name, array, (types or {}).get(g_name, type_name), seed=10_000 + i)
    for i, (name, tensor) in enumerate(sorted(weights.items())):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        array = tensor.astype(np.float32)
        if permuted and name.endswith("q_proj.weight"):
            array = permute_rows(array, heads)
        elif permuted and name.endswith("k_proj.weight"):
            array = permute_rows(array, kv_heads)
        if g_arch in _GEMMA and name.endswith("norm.weight"):
            array = array + 1.0  # the converter stores Gemma's (1 + w) norms with the one added
        g_name = gguf_name(name, g_arch)
        router = g_name.endswith("ffn_gate_inp.weight")  # llama.cpp keeps the router in F32
        kind = (types or {}).get(g_name, type_name) if array.ndim == 2 and not router else "F32"
        _add_tensor(w, g_name, array, kind, seed=i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_long_rope(w: GGUFWriter, cfg: dict, head_dim: int) -> None:
    """Phi-3's long-rope as llama.cpp's converter writes it: the original length, the attention
    factor it computes from context / original (HF's when the config names none), and both factor
    lists as F32 tensors of head_dim / 2."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return
    original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / original
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    for name in ("long", "short"):
        factors = np.array(rope[f"{name}_factor"], dtype=np.float32)
        assert factors.size == head_dim // 2
        w.add_tensor(f"rope_factors_{name}.weight", factors)


def _add_tensor(w: GGUFWriter, name: str, array: np.ndarray, type_name: str, seed: int) -> None:
    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        w.add_tensor(name, array)
    elif type_name == "F16":
        w.add_tensor(name, array.astype(np.float16))
    elif type_name in _K_SCALE_FIELDS:
        rows = int(np.prod(array.shape[:-1]))  # stacked experts: every expert's rows
        blocks = random_k_blocks(rows, array.shape[-1], type_name, seed)
        w.add_tensor(name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
    else:
        w.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)


def _add_tokenizer(w: GGUFWriter, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError("test tokenizer ids are not dense")
    tokens = [t for t, _ in by_id]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    if cfg["model_type"] in ("gemma3_text", "gemma2") and len(tokens) > len(by_id):
        # transformers' Gemma tokenizer adds a <mask> token where the vocabulary has none
        tokens[len(by_id)] = "<mask>"
        special["<mask>"] = len(by_id)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    eos = cfg.get("eos_token_id")
    w.add_eos_token_id(eos if isinstance(eos, int) else eos[0])
    w.add_add_bos_token(False)
    config = model_dir / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    if template:
        w.add_chat_template(template)


def rewrite_gguf(src: Path, out: Path, drop_keys=(), add=None, tensor=None) -> Path:
    """A copy of the F32 file ``src`` with changes: metadata keys starting with any of ``drop_keys``
    left out, ``add(writer)`` writing more, and ``tensor(name, array)`` replacing each tensor's data."""
    from gguf import GGUFReader

    reader = GGUFReader(str(src))
    w = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", *drop_keys)):
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type)
    if add is not None:
        add(w)
    for t in reader.tensors:
        array = np.array(t.data)
        w.add_tensor(t.name, tensor(t.name, array) if tensor is not None else array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
