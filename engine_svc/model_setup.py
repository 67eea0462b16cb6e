"""Building a rank's model and KV cache: shared by the engine (rank 0) and tensor-parallel workers."""

from __future__ import annotations

import torch

from engine_svc.config import EngineConfig
from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.models.loader import init_dummy_weights, load_weights
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard


def load_model(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    shard: Shard,
) -> DecoderForCausalLM:
    with torch.device(device):  # build in place: no host copy of a large model
        model = DecoderForCausalLM(spec, dtype, max_model_len, shard)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, config.model)
    return model


def allocate_kv_caches(
    spec: ModelSpec, shard: Shard, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One tensor per layer, ``[2 (k, v), num_blocks, block_size, local kv heads, head_dim]``.

    Zeroed, not empty: padded reads of never-written slots must not bring NaNs into masked math.
    """
    shape = (2, num_blocks, block_size, shard.kv_heads(spec), spec.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
