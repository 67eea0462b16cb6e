"""Attention over a paged KV cache for a mixed batch of prefill chunks and decodes.

Request b owns query tokens ``query_start_loc[b] : query_start_loc[b+1]`` of the flattened batch;
its context is ``seq_lens[b]`` tokens long (already-cached prefix plus this step's tokens, whose
K/V were written to the cache before this call) and lives in the blocks ``block_tables[b]``.
Query i of a request with q_len queries sits at position ``seq_len - q_len + i`` and attends to
every context position up to and including its own (causal within the chunk); with a ``window`` of
W, only the last W of those (positions > its own - W: a sliding-window layer). With a ``softcap``
(Gemma 2), each scaled score s becomes ``tanh(s / softcap) * softcap`` before the mask and the
softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.length_groups import length_groups


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request's cache, contiguous: ``[length, Hk, D]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


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
    """``q [T, Hq, D]`` -> ``[T, Hq, D]``; GQA when Hq is a multiple of the caches' Hk.

    ``max_query_len`` / ``max_seq_len`` are host-side bounds the caller already knows; GPU kernels
    size their grids with them (no device sync). This reference reads the lengths itself.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    prefills = [b for b in range(len(lens)) if starts[b + 1] - starts[b] > 1]
    check_window(window)
    check_softcap(softcap)
    if window is not None:
        block_tables = window_tables(block_tables, lens, starts, window, k_cache.shape[1])
    for group in length_groups(decodes, lens):
        _decode_batch(q, out, k_cache, v_cache, block_tables, lens, starts, group, scale, window, softcap)
    for b in prefills:
        lo, hi, ctx = starts[b], starts[b + 1], lens[b]
        k = gather_context(k_cache, block_tables[b], ctx)
        v = gather_context(v_cache, block_tables[b], ctx)
        q_len = hi - lo
        # Query i may see context positions <= ctx - q_len + i.
        mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
        if window is not None:  # ... and positions > its own - window
            mask &= torch.ones(q_len, ctx, dtype=torch.bool).triu(diagonal=ctx - q_len - window + 1)
        out[lo:hi] = _sdpa(q[lo:hi], k, v, mask.to(q.device), scale, softcap)
    return out


def window_tables(
    block_tables: torch.Tensor, lens: list[int], starts: list[int], window: int, block_size: int
):
    """The tables with each row's entries before the first block its window reads (from its first
    query's) replaced by that block: a sliding-window layer's cache may have released them (a null
    entry), and the masked positions then read a block the row holds (their weights are 0)."""
    tables = block_tables.clone()
    for b, ctx in enumerate(lens):
        first = max(0, ctx - (starts[b + 1] - starts[b]) + 1 - window) // block_size
        if 0 < first < tables.shape[1]:
            tables[b, :first] = tables[b, first]
    return tables


def check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of positions or None, got {window!r}")


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not (isinstance(softcap, float | int) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def _attention(q, k, v, mask, scale: float, softcap: float | None):
    """``[..., Hq, Lq, D]`` queries over ``[..., Hk, L, D]`` keys and values: SDPA, or with a
    soft-cap its arithmetic written out (scores, cap, mask, softmax, weighted values)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _decode_batch(
    q, out, k_cache, v_cache, block_tables, lens, starts, rows, scale, window=None, softcap=None
) -> None:
    # One query per request: pad every context to the longest and mask the padding, so the whole
    # decode batch is one attention call instead of one per request.
    max_len = max(lens[b] for b in rows)
    block_size = k_cache.shape[1]
    nblk = (max_len + block_size - 1) // block_size
    idx = torch.tensor(rows, device=q.device)
    tables = block_tables[idx, :nblk]
    k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, Hk, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_len]
    lengths = torch.tensor([lens[b] for b in rows], device=q.device)
    positions = torch.arange(max_len, device=q.device)[None, :]
    mask = positions < lengths[:, None]  # [B, L]
    if window is not None:
        mask &= positions >= lengths[:, None] - window
    token_idx = torch.tensor([starts[b] for b in rows], device=q.device)
    qb = q[token_idx].unsqueeze(2)  # [B, Hq, 1, D]
    kb = k.transpose(1, 2).to(q.dtype)  # [B, Hk, L, D]; GQA without materialising repeated heads
    vb = v.transpose(1, 2).to(q.dtype)
    o = _attention(qb, kb, vb, mask[:, None, None, :], scale, softcap)
    out[token_idx] = o.squeeze(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap=None):
    qh = q.transpose(0, 1)  # [Hq, Lq, D]
    kh = k.transpose(0, 1).to(q.dtype)  # [Hk, L, D]
    vh = v.transpose(0, 1).to(q.dtype)
    o = _attention(qh, kh, vh, mask, scale, softcap)
    return o.transpose(0, 1)
