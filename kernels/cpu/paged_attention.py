"""Paged attention for the CPU: the reference's arithmetic (``kernels/reference/paged_attention.py``
defines what is computed) with the copies and kernels chosen for a host.

- K/V leave the cache by whole blocks (``index_select`` on the block axis: one 8 KiB memcpy per
  block at the benchmark shape) rather than advanced indexing, which walks the index per element.
- A decode group is cut into chunks whose gathered K/V stay cache-sized (``DECODE_CHUNK_BYTES``),
  so SDPA reads them from L2/L3 right after the gather instead of from memory.
- Every SDPA call is 4-D, which is what torch's fused CPU kernel
  (``_scaled_dot_product_flash_attention_for_cpu``) takes; the reference's 3-D prefill call falls
  back to the unfused math path (bmm + softmax + masks), about half the speed.

Results equal the reference's within fp32 rounding (tests/test_kernels_cpu.py): a decode group
that fits one chunk is bit-equal to it (same padded length, same SDPA call); chunks pad to the
group's length too, and SDPA then differs by about an ulp with the rows around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference.paged_attention import _length_groups

# Gathered K + V of one decode chunk: a few MiB stays in this core's L2 / the shared L3. Measured
# at batch 64 x 512-token contexts: 4 MiB chunks ~1.4x faster than one 32 MiB gather.
DECODE_CHUNK_BYTES = 4 << 20


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``[0, length)`` of the blocks ``blocks`` ``[..., n]`` as ``[..., length, Hk, D]``."""
    lead = blocks.shape[:-1]
    flat = cache.index_select(0, blocks.reshape(-1))
    return flat.view(*lead, blocks.shape[-1] * cache.shape[1], *cache.shape[2:])[..., :length, :, :]


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
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention.paged_attention``."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    prefills = [b for b in range(len(lens)) if starts[b + 1] - starts[b] > 1]
    block_size = k_cache.shape[1]
    token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # K and V of one position
    tables = block_tables.long()
    for group in _length_groups(decodes, lens):
        padded = lens[group[0]]  # the longest comes first; every chunk pads to it, as one call would
        step = max(1, DECODE_CHUNK_BYTES // (token_bytes * padded))
        for i in range(0, len(group), step):
            _decode_chunk(q, out, k_cache, v_cache, tables, lens, starts, group[i : i + step], padded, scale)
    for b in prefills:
        lo, hi, ctx = starts[b], starts[b + 1], lens[b]
        blocks = tables[b, : (ctx + block_size - 1) // block_size]
        k = gather_blocks(k_cache, blocks, ctx).to(q.dtype)
        v = gather_blocks(v_cache, blocks, ctx).to(q.dtype)
        q_len = hi - lo
        # Query i may see context positions <= ctx - q_len + i.
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - q_len)
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1)[None],  # [1, Hq, Lq, D]
            k.transpose(0, 1)[None],  # [1, Hk, L, D]
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def _decode_chunk(q, out, k_cache, v_cache, tables, lens, starts, rows, max_len, scale) -> None:
    # One query per request, contexts padded to the group's longest and the padding masked: the
    # same arithmetic whether the group is one call or several.
    nblk = (max_len + k_cache.shape[1] - 1) // k_cache.shape[1]
    idx = torch.tensor(rows, device=q.device)
    blocks = tables[idx, :nblk]
    # Half-precision decodes are computed in fp32: torch's fused CPU kernel takes about twice as
    # long on bf16 inputs with one query as on the same data upcast (measured at 16 x 512 tokens).
    dtype = torch.float32 if q.device.type == "cpu" and q.element_size() < 4 else q.dtype
    k = gather_blocks(k_cache, blocks, max_len).transpose(1, 2).to(dtype)  # [B, Hk, L, D], strided
    v = gather_blocks(v_cache, blocks, max_len).transpose(1, 2).to(dtype)
    lengths = torch.tensor([lens[b] for b in rows], device=q.device)
    mask = torch.arange(max_len, device=q.device)[None, :] < lengths[:, None]  # [B, L]
    token_idx = torch.tensor([starts[b] for b in rows], device=q.device)
    o = F.scaled_dot_product_attention(
        q[token_idx].unsqueeze(2).to(dtype),
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[token_idx] = o.squeeze(2).to(out.dtype)
