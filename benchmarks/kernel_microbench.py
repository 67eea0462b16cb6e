"""Timings of the paged-attention kernel: against torch SDPA on the same data, and as a fraction of
the device's memory bandwidth for decodes. Used by the GPU check; runs anywhere (slowly on CPU).

The paged cache here holds exactly the contiguous K/V that SDPA reads: request b's blocks are
``b * blocks_per_request + i``, so both sides see the same bytes and only the kernels differ.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _contiguous_paged(
    batch: int,
    seq_len: int,
    q_len: int,
    hq: int,
    hk: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    shuffle: bool = False,
):
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(batch, seq_len, hk, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(batch, seq_len, hk, d, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(batch * q_len, hq, d, generator=gen).to(device=device, dtype=dtype)
    if seq_len % block_size:
        raise ValueError(f"seq_len {seq_len} must be a multiple of block_size {block_size} here")
    per_req = seq_len // block_size
    k_cache = k.view(batch * per_req, block_size, hk, d)
    v_cache = v.view(batch * per_req, block_size, hk, d)
    table = torch.arange(batch * per_req)
    if shuffle:  # the same bytes in scattered blocks, as in a cache that has run for a while
        order = torch.randperm(batch * per_req, generator=gen)  # physical block p holds logical order[p]
        k_cache, v_cache = k_cache[order.to(device)], v_cache[order.to(device)]
        table = order.argsort()
    tables = table.view(batch, per_req).to(device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    return q, k, v, k_cache, v_cache, tables, seq_lens, qsl


def _sdpa(q, k, v, causal: bool, scale: float):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa; the caller passes expanded K/V instead
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def attention_vs_sdpa(
    paged_attention: Callable,
    *,
    batch: int,
    seq_len: int,
    q_len: int,
    hq: int,
    hk: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    iters: int = 10,
) -> dict:
    """Paged attention time over SDPA time on the same K/V (ratio < 1: ours is faster).

    ``q_len == seq_len`` is a causal prefill; ``q_len == 1`` a batch of decodes.
    """
    dev = torch.device(device)
    q, k, v, k_cache, v_cache, tables, seq_lens, qsl = _contiguous_paged(
        batch, seq_len, q_len, hq, hk, d, block_size, dtype, dev
    )
    scale = d**-0.5

    def ours():
        return paged_attention(
            q, k_cache, v_cache, tables, seq_lens, qsl, scale, max_query_len=q_len, max_seq_len=seq_len
        )

    qs = q.view(batch, q_len, hq, d).transpose(1, 2)
    ks, vs = k.transpose(1, 2), v.transpose(1, 2)
    try:
        F.scaled_dot_product_attention(qs[:1, :, :1], ks[:1, :, :1], vs[:1, :, :1], enable_gqa=True)
    except TypeError:
        ks, vs = ks.repeat_interleave(hq // hk, 1), vs.repeat_interleave(hq // hk, 1)
    causal = q_len > 1

    def theirs():
        return _sdpa(qs, ks, vs, causal, scale)

    err = (ours().float() - theirs().transpose(1, 2).reshape(batch * q_len, hq, d).float()).abs().max()
    ms_ours = time_ms(ours, dev, iters=iters)
    ms_sdpa = time_ms(theirs, dev, iters=iters)
    return dict(
        batch=batch,
        seq_len=seq_len,
        q_len=q_len,
        hq=hq,
        hk=hk,
        head_dim=d,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        ms_paged=ms_ours,
        ms_sdpa=ms_sdpa,
        ratio_paged_over_sdpa=ms_ours / ms_sdpa,
        max_abs_err_vs_sdpa=float(err),
    )


def decode_bandwidth(
    paged_attention: Callable,
    *,
    batch: int,
    seq_len: int,
    hq: int,
    hk: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    peak_bytes_per_s: float | None,
    iters: int = 20,
) -> dict:
    """Achieved memory bandwidth of a decode batch (every K/V byte read once) over the device peak."""
    dev = torch.device(device)
    q, _, _, k_cache, v_cache, tables, seq_lens, qsl = _contiguous_paged(
        batch, seq_len, 1, hq, hk, d, block_size, dtype, dev, shuffle=True
    )
    scale = d**-0.5

    def run():
        return paged_attention(
            q, k_cache, v_cache, tables, seq_lens, qsl, scale, max_query_len=1, max_seq_len=seq_len
        )

    ms = time_ms(run, dev, iters=iters)
    item = torch.finfo(dtype).bits // 8
    moved = 2 * batch * seq_len * hk * d * item + 2 * q.numel() * item + tables.numel() * 4
    achieved = moved / (ms / 1e3)
    return dict(
        batch=batch,
        seq_len=seq_len,
        hq=hq,
        hk=hk,
        head_dim=d,
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        ms=ms,
        bytes_moved=moved,
        achieved_gb_per_s=achieved / 1e9,
        peak_gb_per_s=peak_bytes_per_s / 1e9 if peak_bytes_per_s else None,
        fraction_of_peak=achieved / peak_bytes_per_s if peak_bytes_per_s else None,
    )
