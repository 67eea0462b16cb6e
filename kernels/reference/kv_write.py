"""Store one step's keys and values into the paged cache, token t into slot ``slot_mapping[t]``."""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k, v [T, Hk, D]``; caches ``[num_blocks, block_size, Hk, D]``; slot = block * block_size + offset.

    A negative slot means "do not store" (padding tokens).
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
