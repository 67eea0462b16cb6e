"""Every Triton kernel against its torch reference on one device, as plain records.

The GPU check runs this on CUDA in bf16/fp16 with the same cases the CPU tests run under the
interpreter (``tests.kernel_cases``); each record says what was compared, the largest error and the
tolerance, so a failure on a GPU machine is readable from the JSON alone.
"""

from __future__ import annotations

import torch

from kernels.backend import Kernels
from kernels.reference import activation, kv_write, lora, paged_attention, rmsnorm, rotary
from tests.kernel_cases import (
    MIXED_CASES,
    SPLIT_DECODE_CASES,
    WINDOW_CASES,
    WINDOW_SPLIT_CASES,
    AttentionCase,
    make_paged_batch,
)
from tests.lora_cases import LORA_CASES, make_lora_case

# (rtol, atol) per dtype; bf16 keeps 8 mantissa bits, so one rounding step is ~4e-3 relative.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 2e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}


def _record(kernel: str, case: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor) -> dict:
    rtol, atol = TOLERANCES[dtype]
    got, want = got.float(), want.float()
    err = (got - want).abs()
    ok = bool(torch.isfinite(got).all()) and bool((err <= atol + rtol * want.abs()).all())
    return dict(
        kernel=kernel,
        case=case,
        dtype=str(dtype).removeprefix("torch."),
        ok=ok,
        max_abs_err=float(err.max()) if err.numel() else 0.0,
        rtol=rtol,
        atol=atol,
    )


def check_elementwise(k: Kernels, device: str, dtype: torch.dtype, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    records = []
    for hidden in (200, 4096):
        x, res, w = rand(7, hidden), rand(7, hidden), rand(hidden)
        got, got_res = k.rms_norm(x, w, 1e-5, res)
        want, want_res = rmsnorm.rms_norm(x, w, 1e-5, res)
        records.append(_record("rms_norm", f"h{hidden}", dtype, got, want))
        records.append(_record("rms_norm.residual", f"h{hidden}", dtype, got_res, want_res))
    for d in (176, 14336):
        x = rand(5, 2 * d)
        records.append(_record("silu_and_mul", f"d{d}", dtype, k.silu_and_mul(x), activation.silu_and_mul(x)))
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    for head_dim in (64, 128):
        cache = rotary.rope_cos_sin_cache(rotary.rope_inv_freq(head_dim, 500000.0, scaling), 300).to(device)
        q, kk = rand(13, 32, head_dim), rand(13, 8, head_dim)
        positions = torch.randint(0, 300, (13,), generator=gen).to(device)
        got_q, got_k = k.apply_rotary(positions, q, kk, cache)
        want_q, want_k = rotary.apply_rotary(positions, q, kk, cache)
        records.append(_record("apply_rotary.q", f"d{head_dim}", dtype, got_q, want_q))
        records.append(_record("apply_rotary.k", f"d{head_dim}", dtype, got_k, want_k))
    for block_size, strided in ((16, False), (32, False), (16, True)):
        caches = [rand(5, block_size, 8, 128) for _ in range(2)]
        ref_caches = [c.clone() for c in caches]
        kn, vn = rand(6, 8, 128), rand(6, 8, 128)
        slots = torch.tensor(
            [5, -1, 3 * block_size, 2 * block_size + 7, 1, 4 * block_size - 1], device=device
        )
        if strided:  # a KV cache group's row of a windowed model's [G, T] slots (laid out [T, G])
            slots = torch.stack([slots, slots.flip(0)], dim=1)[:, 0]
        k.write_kv(kn, vn, *caches, slots)
        kv_write.write_kv(kn, vn, *ref_caches, slots)
        exact = torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
        records.append(
            dict(
                kernel="write_kv",
                case=f"bs{block_size}" + ("-strided-slots" if strided else ""),
                dtype=str(dtype).removeprefix("torch."),
                ok=exact,
                max_abs_err=0.0 if exact else float("nan"),
                rtol=0.0,
                atol=0.0,
            )
        )
    return records


def check_attention(
    k: Kernels,
    device: str,
    dtype: torch.dtype,
    cases: tuple[AttentionCase, ...] = MIXED_CASES + SPLIT_DECODE_CASES + WINDOW_CASES + WINDOW_SPLIT_CASES,
) -> list[dict]:
    """Each case against the reference; a windowed or soft-capped case (``case.layer()``) passes
    its window and cap to both."""
    records = []
    for case in cases:
        batch = make_paged_batch(case, dtype, device=device)
        want = paged_attention.paged_attention(*batch.args(), **batch.layer)
        got = k.paged_attention(*batch.args(), **batch.bounds(), **batch.layer)
        records.append(_record("paged_attention", case.label, dtype, got, want))
    return records


def check_lora(k: Kernels, device: str, dtype: torch.dtype) -> list[dict]:
    """The batched LoRA apply (a mix of base tokens and several adapters, into a column slice of a
    wider output) against the torch twin."""
    records = []
    for case in LORA_CASES:
        got, want = make_lora_case(case, dtype, device), make_lora_case(case, dtype, device)
        slots = torch.from_numpy(got.token_slots.astype("int32")).to(device)
        k.lora_apply(got.out, got.x, got.a, got.b, slots, got.plan(device), got.max_rank)
        lora.lora_apply(want.out, want.x, want.a, want.b, slots, want.plan(device), want.max_rank)
        records.append(_record("lora_apply", case[0], dtype, got.out, want.out))
    return records


def check_all(k: Kernels, device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    records = []
    for dtype in dtypes:
        records += check_elementwise(k, device, dtype)
        records += check_attention(k, device, dtype)
        records += check_lora(k, device, dtype)
    return records
