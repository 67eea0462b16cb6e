"""Paged attention entry point: picks the varlen kernel or the split-KV decode path.

The choice uses only host-side numbers (shapes and the caller's ``max_query_len`` /
``max_seq_len``), so dispatching never waits for the device. A batch of decodes only, with contexts
long enough that too few programs would each walk a long context, takes the split-KV path; every
other batch (any prefill chunk in it) runs the varlen kernel. A sliding-window layer counts only
its window's keys toward "long" (that is all a decode reads).
"""

from __future__ import annotations

import functools

import torch

from kernels.reference.paged_attention import check_softcap, check_window
from kernels.triton.paged_attention_split_kv import choose_num_splits, split_kv_decode_attention
from kernels.triton.paged_attention_varlen import varlen_paged_attention

# Programs that keep one streaming multiprocessor busy enough to hide memory latency.
PROGRAMS_PER_SM = 2
# Without a GPU (the interpreter) there is no occupancy to fill; split whenever contexts are long,
# so the CPU tests take the same path a GPU takes on small batches.
CPU_TARGET_PROGRAMS = 64


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention.paged_attention`` (``window``: a
    sliding-window layer's width; ``softcap``: its scores' tanh soft-cap)."""
    check_window(window)
    check_softcap(softcap)
    if block_tables.stride(-1) != 1:
        raise ValueError(
            f"block_tables must have dense rows (an entry stride of 1), got {block_tables.stride()}"
        )
    if max_query_len is None:  # fallback for callers without host-side bounds: this syncs
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if len(seq_lens) else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if len(seq_lens) else 0
    if max_query_len <= 1:
        span = max_seq_len if window is None else min(max_seq_len, window)
        splits = choose_num_splits(block_tables.shape[0], k_cache.shape[2], span, target_programs(q.device))
        if splits > 1:
            return split_kv_decode_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                scale,
                max_seq_len,
                splits,
                window=window,
                softcap=softcap,
            )
    return varlen_paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len,
        window=window,
        softcap=softcap,
    )


def target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_TARGET_PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
