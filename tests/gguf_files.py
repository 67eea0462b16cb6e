"""GGUF files for tests, written with the ``gguf`` package's own writer the way llama.cpp's
converter lays them out: its tensor names, dimensions in reverse, and the Llama family's q/k rows
permuted for its rotary layout. The engine's reader undoes all of that; transformers' GGUF loader
(an independent reader) undoes it too, so the two must agree on every file written here. What
differs between architectures is read from their declarations (engine_svc/models/arch/): no
architecture is named here.

``gguf.quants`` can quantize F16, BF16, Q8_0 and Q4/Q5 blocks; the K-quant types (Q2_K..Q6_K) have
no quantizer there, so their blocks are random bytes with finite, small scale fields: any bit
pattern of the packed quants is a valid block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file

from engine_svc.models import arch as archs
from engine_svc.models.arch import GLOBAL_GGUF_NAMES, Architecture

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


def declaration(model_dir: Path, arch: str | None = None) -> Architecture:
    """The declaration a file of the model in ``model_dir`` is written by: its config's
    ``architectures`` entry's, or GGUF architecture ``arch``'s (a file written as another one)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if arch is None:
        decl = archs.by_name(cfg["architectures"][0])
    else:
        decl = archs.by_gguf(arch, experts=bool(cfg.get("num_experts") or cfg.get("num_local_experts")))
    if decl is None or decl.gguf is None:
        raise ValueError(f"no GGUF architecture declared for {arch or cfg['architectures'][0]}")
    return decl


def _identity(decl: Architecture, hf_suffix: str) -> str:
    """What an HF per-layer tensor is to the decoder: its slot, an expert slot, or (a fused tensor)
    its own name; two spellings of one tensor (Mixtral's router) are one identity."""
    if hf_suffix in decl.layer_weights:
        return decl.layer_weights[hf_suffix]
    expert = decl.expert_slot(hf_suffix)
    return expert[0] if expert else hf_suffix


def gguf_name(hf_name: str, decl: Architecture | None = None) -> str:
    """llama.cpp's name of HF tensor ``hf_name``: the declaration's (default: Llama's) ``gguf_names``
    read backwards (a per-expert HF tensor: the name of the stacked tensor of every expert)."""
    decl = decl or archs.by_name("LlamaForCausalLM")
    top = {hf: g for g, hf in GLOBAL_GGUF_NAMES.items()}
    if hf_name in top:
        return top[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    by_identity = {_identity(decl, hf): g for g, hf in decl.gguf_names.items()}
    name = by_identity.get(_identity(decl, rest))
    if name is None:
        raise ValueError(f"{decl.name}: no GGUF name declared for {rest}")
    return f"blk.{index}.{name}"


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
    GGUF tensor name (``blk.0.attn_q.weight``) -> its own type, for a file of mixed formats; ``arch``:
    the GGUF architecture to write it as (default: as llama.cpp's converter writes its own).

    Everything architecture-specific comes from the declaration (engine_svc/models/arch/): the GGUF
    architecture (``gguf_written``), the tensor names (``gguf_names``, read backwards), the q/k row
    permutation (``gguf_permuted_qk``) and the norms' stored ``1 + w`` (``norm_offset``)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    decl = declaration(model_dir, arch)
    g_arch = arch or decl.gguf_written
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = GGUFWriter(str(out), g_arch)
    w.add_name(f"test {arch or cfg['model_type']} {type_name}")
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
    if decl.attn_softcap_key and cfg.get(decl.attn_softcap_key):
        w.add_attn_logit_softcapping(cfg[decl.attn_softcap_key])
    if decl.final_softcap_key and cfg.get(decl.final_softcap_key):
        w.add_final_logit_softcapping(cfg[decl.final_softcap_key])
    _add_long_rope(w, cfg, head_dim)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        w.add_sliding_window(cfg["sliding_window"])  # (Gemma's local layers'; Mixtral's, every layer's)
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
    permuted = decl.gguf_permuted_qk
    # Routed experts: each expert's HF tensor goes into GGUF's stacked one of every expert ([E, rows, cols])
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name in list(weights):
        parts = name.split(".", 3)
        expert = decl.expert_slot(parts[3]) if len(parts) == 4 and parts[1] == "layers" else None
        if expert is not None and expert[1] is not None:
            stacked.setdefault(gguf_name(name, decl), {})[expert[1]] = weights.pop(name)
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
        if decl.norm_offset and name.endswith("norm.weight"):
            array = array + decl.norm_offset  # the converter stores (1 + w) norms with the one added
        g_name = gguf_name(name, decl)
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
    if _tokenizer_adds_mask(cfg["model_type"]) and len(tokens) > len(by_id):
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


def _tokenizer_adds_mask(model_type: str) -> bool:
    """Whether transformers' tokenizer class of ``model_type`` has a ``<mask>`` token by default (Gemma's)."""
    import inspect

    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    cls = getattr(transformers, TOKENIZER_MAPPING_NAMES.get(model_type) or "", None)
    mask = inspect.signature(cls.__init__).parameters.get("mask_token") if cls is not None else None
    return mask is not None and mask.default == "<mask>"


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
