"""SmolLM3: Llama's layer, except that some layers apply no rotary embedding (NoPE). A layer ``i``
with ``no_rope_layers[i] == 0`` leaves q and k as projected (transformers' default list: every
``no_rope_layer_interval``-th layer, 4, counting from one). With ``use_sliding_window``, the layers
``layer_types`` names ``sliding_attention`` attend to the last ``sliding_window`` positions; every
other layer to the whole context. ``attention_bias`` adds biases to q/k/v and o (as Llama's).

A NoPE layer is declared as a rotary table of its own kind (``rope_type: "none"``): the identity
rotation, cos 1 and sin 0 at every position, which leaves q and k bit for bit (``x * 1 + y * 0``),
so every path that rotates (the native rotary-and-store, the layer loop, the Triton and torch
kernels) serves it as it is.

GGUF (llama.cpp's converter, ``smollm3``): Llama's tensors, q/k rows permuted; the NoPE layers are
not in the file: llama.cpp fixes them at every fourth layer (``(i + 1) % 4 == 0``), as here.
"""

from engine_svc.models.arch import Architecture, LayerAttention, register, rope_of

NO_ROPE = {"rope_type": "none"}  # the identity rotation (kernels/reference/rotary.py)
NO_ROPE_INTERVAL = 4  # transformers' default, and llama.cpp's fixed step


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    n = cfg["num_hidden_layers"]
    if cfg.get("mlp_bias"):
        raise ValueError("SmolLM3ForCausalLM: mlp_bias is not supported")
    interval = cfg.get("no_rope_layer_interval") or NO_ROPE_INTERVAL
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise ValueError(f"no_rope_layers has {len(uses_rope)} entries; num_hidden_layers is {n}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types") or ["full_attention"] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries; num_hidden_layers is {n}")
    theta, scaling = rope_of(cfg)
    out = []
    for i, (rope, kind) in enumerate(zip(uses_rope, types, strict=True)):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"layer_types[{i}] is {kind!r}; SmolLM3 has full_attention and sliding_attention"
            )
        layer_window = window if kind == "sliding_attention" else None
        out.append(LayerAttention(layer_window, theta, scaling if rope else NO_ROPE))
    return tuple(out)


def gguf_config(ckpt) -> dict:
    return {"no_rope_layer_interval": NO_ROPE_INTERVAL}


SMOLLM3 = register(
    Architecture(
        name="SmolLM3ForCausalLM",
        gguf="smollm3",
        layers=layers,
        window_served=True,
        gguf_permuted_qk=True,
        gguf_config=gguf_config,
        features=frozenset(),  # LoRA, speculation and tensor parallelism not tested on it yet
        model_type="smollm3",
        tiny_config={"pad_token_id": None},  # (tied embeddings by default)
    )
)
