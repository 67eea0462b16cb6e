"""Every Triton kernel compiles to a Hopper (sm_90: H100/H200) binary, on a machine with no GPU.

The interpreter runs the kernels' arithmetic but not Triton's compiler, which rejects things the
interpreter accepts (non-constexpr globals, loop-carried type changes, unsupported dot shapes). Here
the Python wrappers run on CPU tensors as usual, but every kernel launch is captured instead of
executed, and each captured launch (its argument types and constexprs, as the wrapper chose them)
is compiled ahead of time for sm_90 down to a cubin with the ptxas that ships with Triton.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference.rotary import rope_cos_sin_cache, rope_inv_freq
from tests.kernel_cases import (
    MIXED_CASES,
    SPLIT_DECODE_CASES,
    WINDOW_CASES,
    WINDOW_SPLIT_CASES,
    make_paged_batch,
)
from tests.triton_mode import triton_mode

HOPPER_SHARED_MEMORY = 232448  # bytes per block on H100/H200 (227 KiB)
TYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
KERNEL_MODULES = (
    "rmsnorm",
    "activation",
    "rotary",
    "kv_write",
    "paged_attention_varlen",
    "paged_attention_split_kv",
)


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` records, runs nothing."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _signature(fn, args, kwargs):
    names = [p.name for p in fn.params]
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    signature, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPE_NAMES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs} | {"enable_fp_fusion": True}
    return signature, constexprs, options


@pytest.fixture(scope="module")
def captured_launches():
    import importlib

    launches: list = []
    with triton_mode(interpret=False):
        from triton.runtime.jit import JITFunction

        from kernels.triton import registry

        patched = []
        for name in KERNEL_MODULES:
            module = importlib.import_module(f"kernels.triton.{name}")
            for attr, value in vars(module).items():
                if isinstance(value, JITFunction) and attr.endswith("_kernel"):
                    patched.append((module, attr, value))
                    setattr(module, attr, LaunchRecorder(value, launches))
        _drive_every_wrapper(registry.TRITON_KERNELS)
        yield launches
        for module, attr, value in patched:
            setattr(module, attr, value)


def _drive_every_wrapper(k) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(3, 4096).to(dtype)
        weight = torch.randn(4096).to(dtype)
        k.rms_norm(x, weight, 1e-5)
        k.rms_norm(x, weight, 1e-5, x.clone())
        k.silu_and_mul(torch.randn(3, 2 * 14336).to(dtype))
        cache = rope_cos_sin_cache(rope_inv_freq(128, 500000.0), 64)
        k.apply_rotary(
            torch.arange(3), torch.randn(3, 32, 128).to(dtype), torch.randn(3, 8, 128).to(dtype), cache
        )
        kv = torch.zeros(4, 16, 8, 128, dtype=dtype)
        k.write_kv(
            torch.randn(3, 8, 128).to(dtype),
            torch.randn(3, 8, 128).to(dtype),
            kv,
            kv.clone(),
            torch.tensor([0, 5, -1]),
        )
        cases = (MIXED_CASES[1], MIXED_CASES[2], SPLIT_DECODE_CASES[0], SPLIT_DECODE_CASES[1])
        # sliding windows, soft-caps and both, in the varlen and the split-KV kernels
        cases += (WINDOW_CASES[0], WINDOW_CASES[2], WINDOW_CASES[3]) + WINDOW_SPLIT_CASES
        for case in cases:
            batch = make_paged_batch(case, dtype)
            k.paged_attention(*batch.args(), **batch.bounds(), **batch.layer)
        decode_only = make_paged_batch(MIXED_CASES[0], dtype)
        k.paged_attention(*decode_only.args(), max_query_len=1, max_seq_len=64)
    fp32 = make_paged_batch(MIXED_CASES[3], torch.float32)  # fp32: the full-precision dot
    k.paged_attention(*fp32.args(), **fp32.bounds())


def test_every_kernel_is_launched_by_the_wrappers(captured_launches):
    launched = {fn.__name__ for fn, _, _ in captured_launches}
    assert launched == {
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_rotary_kernel",
        "_write_kv_kernel",
        "_varlen_attention_kernel",
        "_split_decode_kernel",
        "_merge_splits_kernel",
    }


def test_every_launch_compiles_for_sm90(captured_launches):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    seen = set()
    with triton_mode(interpret=False):
        for fn, args, kwargs in captured_launches:
            signature, constexprs, options = _signature(fn, args, kwargs)
            key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())))
            if key in seen:
                continue
            seen.add(key)
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
            )
            assert compiled.asm.get("cubin"), fn.__name__
            assert compiled.metadata.shared <= HOPPER_SHARED_MEMORY, (fn.__name__, compiled.metadata.shared)
    assert len(seen) >= 24
