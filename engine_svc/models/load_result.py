"""What a model's load decided, declared once (``model_setup.load_model`` returns it with the
model): the rest of the engine reads these fields instead of attributes set on the model after it
was built."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoadResult:
    # The linears' weights: "gguf" (the file's blocks), "int8" / "int4" (blocks made at load) or
    # "none" (float) -- ``quantized_weights.resolve_quantization``.
    quantization: str
    # What the quantized linears multiply: "int8" or "none" (fp32) -- ``resolve_activations``.
    quantized_activations: str
    # What flows between the ops, and what the KV cache and LoRA hold: the weights' dtype, except
    # on the native bf16 path (bf16 weights packed, fp32 activations).
    activation_dtype: torch.dtype
    # The float parameters the load freed (``float_weights.free_packed_float_weights``: a packed
    # linear holds its own copy, or the lookup reads the file's blocks), by name
    # (``float_weights.projections``' names), each with why; their storage is an empty tensor.
    released: dict[str, str] = field(default_factory=dict)
    # (The linears' backend is the model's own: ``model.linear_backend``, set by ``prepare_linears``.)
