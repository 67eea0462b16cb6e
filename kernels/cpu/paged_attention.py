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

from kernels.length_groups import length_groups
from kernels.reference import paged_attention as reference

# Gathered K + V of one decode chunk: a few MiB stays in this core's L2 / the shared L3. Measured
# at batch 64 x 512-token contexts: 4 MiB chunks ~1.4x faster than one 32 MiB gather.
DECODE_CHUNK_BYTES = 4 << 20
# Cascade attention (below) takes decode rows that share at least this many cached prefix tokens,
# in groups of at least this many rows.
CASCADE_MIN_ROWS = 4
CASCADE_MIN_TOKENS = 128


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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention.paged_attention``. A sliding-window layer
    (``window``) or one with soft-capped scores (``softcap``) runs the reference's arithmetic (no
    cascade, no chunked decode groups)."""
    if window is not None or softcap is not None:
        return reference.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            window=window,
            softcap=softcap,
        )
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    prefills = [b for b in range(len(lens)) if starts[b + 1] - starts[b] > 1]
    block_size = k_cache.shape[1]
    token_bytes = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # K and V of one position
    tables = block_tables.long()
    if len(decodes) >= CASCADE_MIN_ROWS:
        decodes = _cascade_decodes(q, out, k_cache, v_cache, tables, lens, starts, decodes, scale)
    for group in length_groups(decodes, lens):
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


def shared_prefix_groups(tables: torch.Tensor, rows: list[int], lens: list[int], block_size: int):
    """``[(rows, num_shared_blocks)]``: decode rows whose block tables begin with the same block ids
    (the same cached prefix: a system prompt, a fork's prompt), and how many leading blocks all of
    them share, never reaching any row's last token. Groups too small to pay are left out."""
    by_first: dict[int, list[int]] = {}
    firsts = tables[rows, 0].tolist()
    for b, first in zip(rows, firsts, strict=True):
        by_first.setdefault(first, []).append(b)
    groups = []
    for members in by_first.values():
        if len(members) < CASCADE_MIN_ROWS:
            continue
        limit = (min(lens[b] for b in members) - 1) // block_size
        if limit * block_size < CASCADE_MIN_TOKENS:
            continue
        t = tables[members, :limit]
        same = (t == t[:1]).all(dim=0)
        shared = limit if bool(same.all()) else int(same.to(torch.int8).argmin())
        if shared * block_size >= CASCADE_MIN_TOKENS:
            groups.append((members, shared))
    return groups


def _cascade_decodes(q, out, k_cache, v_cache, tables, lens, starts, decodes, scale) -> list[int]:
    """Cascade attention for decodes that share a cached prefix: the prefix's K/V leave the cache
    once, and every query of the group meets them in one matmul per KV head (instead of one copy
    and one matrix-vector product per row); each row's own suffix is attended separately, and the
    two partial softmaxes are merged by their log-sum-exp. Returns the rows it did not take."""
    block_size = k_cache.shape[1]
    groups = shared_prefix_groups(tables, decodes, lens, block_size)
    if not groups:
        return decodes
    taken: set[int] = set()
    dtype = torch.float32 if q.device.type == "cpu" and q.element_size() < 4 else q.dtype
    hk, d = k_cache.shape[2], k_cache.shape[3]
    for rows, shared in groups:
        g, hq = len(rows), q.shape[1]
        rep = hq // hk
        token_idx = torch.tensor([starts[b] for b in rows], device=q.device)
        qg = q[token_idx].to(dtype)  # [G, Hq, D]
        # The shared prefix: every query of the group against it, per KV head, in one fused call.
        prefix_blocks = tables[rows[0], :shared]
        kp = gather_blocks(k_cache, prefix_blocks, shared * block_size).to(dtype)  # [Lp, Hk, D]
        vp = gather_blocks(v_cache, prefix_blocks, shared * block_size).to(dtype)
        qp = qg.view(g, hk, rep, d).transpose(0, 1).reshape(1, hk, g * rep, d)
        o1, lse1 = _flash(qp, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], None, scale)
        o1 = o1[0].view(hk, g, rep, d).transpose(0, 1).reshape(g, hq, d)
        lse1 = lse1[0].view(hk, g, rep).transpose(0, 1).reshape(g, hq)
        # Each row's own tokens after the prefix, padded to the longest and masked.
        suffix_lens = torch.tensor([lens[b] - shared * block_size for b in rows], device=q.device)
        longest = int(suffix_lens.max())
        blocks = tables[rows, shared : shared + -(-longest // block_size)]
        ks = gather_blocks(k_cache, blocks, longest).to(dtype).transpose(1, 2)  # [G, Hk, Ls, D]
        vs = gather_blocks(v_cache, blocks, longest).to(dtype).transpose(1, 2)
        keep = torch.arange(longest, device=q.device)[None, :] < suffix_lens[:, None]
        # A KV head's rep query heads enter as rep query positions: no copies of K/V for GQA.
        o2, lse2 = _flash(qg.view(g, hk, rep, d), ks, vs, keep[:, None, None, :], scale)
        o2, lse2 = o2.reshape(g, hq, d), lse2.reshape(g, hq)
        # Merge the two partial softmaxes by their log-sum-exp.
        m = torch.maximum(lse1, lse2)
        w1, w2 = (lse1 - m).exp_().unsqueeze(-1), (lse2 - m).exp_().unsqueeze(-1)
        o = (o1 * w1 + o2 * w2) / (w1 + w2)
        out[token_idx] = o.reshape(g, hq, d).to(out.dtype)
        taken.update(rows)
    return [b for b in decodes if b not in taken]


def _flash(q, k, v, mask, scale):
    """torch's fused CPU attention, which also returns each query's log-sum-exp ``[B, H, Lq]``."""
    if mask is not None:  # the kernel takes an additive float mask
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)


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
    g, hq, hk, d = len(rows), q.shape[1], k.shape[1], q.shape[2]
    # A KV head's hq/hk query heads enter as that many query positions (one decode has no causal
    # order among them): the fused kernel then reads each K/V row once, where enable_gqa made
    # 1.5-2x slower calls (measured at 16 x 1100 tokens, 8 query / 2 KV heads).
    o = F.scaled_dot_product_attention(
        q[token_idx].to(dtype).view(g, hk, hq // hk, d), k, v, attn_mask=mask[:, None, None, :], scale=scale
    )
    out[token_idx] = o.reshape(g, hq, d).to(out.dtype)
