"""The model's linear layers. On a CPU in fp32: the native GEMM on a weight packed once at load time
(``kernels/cpu/native_gemm.py``; faster than oneDNN at decode sizes, and a row's result never
depends on its batch) where its build measured faster; else oneDNN with weights reordered once
into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, the
path inductor uses for CPU linears; also bf16); plain ``F.linear`` on CUDA, where neither runs, or
when asked.

In bf16 (fp16) on a CPU, ``auto`` (and ``native``) resolve to ``native_bf16`` (``native_f16``): the
native GEMM with the weights packed as bf16 (fp16) and fp32 activations, so that the model runs fp32
between its linears (the loader converts the other parameters: ``engine_svc/model_setup.py``). That
keeps every op on the batch-invariant native kernels, reads half of fp32's weight bytes, and makes
the result HF's fp32 forward on the bf16 (fp16) weights widened (docs/quantization.md, "bf16 and fp16
weights"). ``onednn`` keeps bf16
activations end to end (its kernels change with the row count, so it is not batch invariant).

On a CPU the prepacked GEMM skips the per-call packing of the weight that the default dense path
does, which is most of the gap at the engine's shapes (M = 1..512 tokens, K = 512..1408): see
docs/design/native-cpu-kernels.md ("The CPU path's pieces"). Results equal ``F.linear`` within fp32
rounding (a different order of the same sums); a probe at load time checks this, and any failure
falls back to ``F.linear``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from kernels.cpu import native_gemm
from kernels.cpu.features import cpu_features, native_bf16

log = logging.getLogger(__name__)

# Every distinct row count M of a packed GEMM leaves state behind in two shape-keyed LRU caches: ideep's
# (``LRU_CACHE_CAPACITY``) and oneDNN's primitives (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries
# each by default, each entry's scratch growing with M x N. A serving engine meets hundreds of M
# values (tokens per step): measured, 231 row counts x 3 GEMM shapes grew the resident set by 376 MiB
# at the defaults, 34 MiB at 64 entries and 3 MiB at 16, and 16 entries left the engine's tokens per
# CPU-second unchanged (a new shape costs a few ms once; a step's M changes slowly). Both caches read
# the variable when first used, so setting it here, before any oneDNN call, takes effect; a value
# the user set stays.
ONEDNN_CACHE_ENTRIES = "16"
for _var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_var, ONEDNN_CACHE_ENTRIES)

LINEAR_BACKENDS = ("auto", "native", "onednn", "dense")
NATIVE_BF16 = "native_bf16"  # what "native" resolves to for bf16 weights (fp32 activations)
NATIVE_F16 = "native_f16"  # ... and for fp16 weights
NATIVE_HALF = {torch.bfloat16: NATIVE_BF16, torch.float16: NATIVE_F16}
# linear_dtype="bfloat16": bf16 weights, the activations rounded to bf16 in the GEMM (bf16 products)
NATIVE_BF16_DOT = "native_bf16_dot"
NATIVE_FP32_BETWEEN = (*NATIVE_HALF.values(), NATIVE_BF16_DOT)  # fp32 activations between the ops


class DenseLinear:
    """``F.linear`` on the weight as loaded."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDNNLinear:
    """oneDNN's linear on a weight reordered once into its blocked layout (an opaque tensor that
    only ``_linear_pointwise`` reads). No batch-size hint: measured as fast as a matching hint at
    every M from 16 to 512, where a hint of 1 costs up to 25% at M = 16."""

    kind = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def onednn_unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the oneDNN path cannot serve this device and dtype here, or None when it can."""
    if device.type != "cpu":
        return f"device is {device.type}"
    if not cpu_features()["onednn"]:
        return "this torch build has no oneDNN linear ops"
    if dtype == torch.bfloat16 and not native_bf16():
        return "no AVX-512 BF16 / AMX on this CPU"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} is not served by the prepacked path"
    return None


def resolve_linear_backend(requested: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """``"native"``, ``"native_bf16"`` / ``"native_f16"`` (the native GEMM on bf16 / fp16 weights, fp32
    activations),
    ``"onednn"`` or ``"dense"``. ``auto`` (None) takes the native GEMM where it runs and measured
    faster, else oneDNN where it can run; asking for one by name where it cannot run is an error,
    not a silent fallback."""
    requested = requested or "auto"
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {requested!r}")
    if requested == "dense":
        return "dense"
    for name in ("native", "onednn") if requested == "auto" else (requested,):
        reason = _unusable_reason(name, device, dtype, forced=requested == name)
        if reason is None and not _probe_ok(dtype, _PACKED[name]):
            reason = "the load-time probe did not match F.linear"
        if reason is None:
            return NATIVE_HALF.get(dtype, name) if name == "native" else name
        if requested == name:
            raise ValueError(f"linear_backend {name!r} is unavailable: {reason}")
        log.info("linear layers: not %s (%s)", name, reason)
    log.info("linear layers: F.linear (%s)", reason)
    return "dense"


def _unusable_reason(name: str, device: torch.device, dtype: torch.dtype, *, forced: bool) -> str | None:
    if name == "onednn":
        return onednn_unusable_reason(device, dtype)
    if device.type != "cpu":
        return f"device is {device.type}"
    return native_gemm.unusable_reason(dtype, forced=forced)


def _native_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None):
    return native_gemm.NativeLinear(weight, bias, weight_dtype=torch.bfloat16)


def _native_f16(weight: torch.Tensor, bias: torch.Tensor | None = None):
    return native_gemm.NativeLinear(weight, bias, weight_dtype=torch.float16)


def _native_bf16_dot(weight: torch.Tensor, bias: torch.Tensor | None = None):
    return native_gemm.NativeLinear(weight, bias, weight_dtype=torch.bfloat16, products="bfloat16")


def linear_products_backend(
    linear_dtype: str | None, backend: str, dtype: torch.dtype, *, blocks: bool
) -> str:
    """The backend once ``linear_dtype`` is applied: "bfloat16" turns the native GEMM on bf16 weights
    (``native_bf16``) into bf16 products (``native_bf16_dot``); it takes nothing else, and says why."""
    if linear_dtype in (None, "auto", "float32"):
        return backend
    if blocks:
        raise ValueError(
            "linear_dtype='bfloat16' forms bf16 products from bf16 weights; this model's linears are "
            "quantized blocks (a GGUF file or quantization=...), which have their own activations "
            "(quantized_activations)"
        )
    if backend != NATIVE_BF16:
        raise ValueError(
            "linear_dtype='bfloat16' forms bf16 products from bf16 weights on the CPU's native GEMM; "
            f"this load's weights are {str(dtype).removeprefix('torch.')} on the {backend!r} linears "
            "(it needs a bf16 checkpoint at dtype 'auto' or 'bfloat16', device 'cpu' and "
            "linear_backend 'auto' or 'native')"
        )
    return NATIVE_BF16_DOT


_PACKED = {
    "native": native_gemm.NativeLinear,
    "onednn": OneDNNLinear,
    NATIVE_BF16: _native_bf16,
    NATIVE_F16: _native_f16,
    NATIVE_BF16_DOT: _native_bf16_dot,
}


def make_linear(backend: str, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks=None):
    """The projection's GEMM. A weight given with its quantized blocks (``blocks``: the load's
    ``QuantizedBlocks`` entry for it, see ``engine_svc/models/quantized_weights.py``) runs on the
    quantized GEMM (with int8 activations
    where the blocks say ``activations="int8"``) unless ``dense`` was asked for (then ``F.linear``
    on the float parameter). ``native_bf16`` / ``native_f16`` pack the weight rounded to bf16 / fp16
    (exact when it was loaded so, whatever its dtype now). A weight freed at load (left empty: see
    ``engine_svc/models/float_weights.py``) is refused: its values are gone."""
    if weight.numel() == 0:  # no linear has an empty weight: this one's storage was freed
        raise RuntimeError(
            "cannot build a linear from a freed weight (the load freed it: its LoadResult.released "
            "says why); load the model again"
        )
    if blocks is not None and backend != "dense":
        # A GGUF file's blocks are read into the kernels' form only for this packing (LazyBlocks)
        read = blocks.materialize() if hasattr(type(blocks), "materialize") else blocks
        try:
            if isinstance(read, torch.Tensor):  # a GGUF file's F16 / BF16 values, as stored
                return native_gemm.NativeLinear(read, bias)
            if blocks.activations == "int8":
                from kernels.cpu.quant_int8act import Int8ActLinear

                return Int8ActLinear(read, bias)
            from kernels.cpu.quant_gemm import QuantLinear

            return QuantLinear(read, bias)
        finally:
            if read is not blocks:
                blocks.release()
    return _PACKED.get(backend, DenseLinear)(weight, bias)


def _probe_ok(dtype: torch.dtype, kind=None) -> bool:
    """One small GEMM through a packed path (oneDNN's unless ``kind`` says) against F.linear: a
    broken or partial build falls back instead of serving wrong numbers."""
    kind = kind or OneDNNLinear
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        x = torch.randn(5, 40, generator=g).to(dtype)
        got = kind(w, b)(x).float()
        want = F.linear(x.float(), w.float(), b.float())
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got, want, rtol=tol, atol=tol * 10))
    except Exception as exc:  # an op that exists but fails on this CPU
        log.warning("oneDNN linear probe failed: %s", exc)
        return False
