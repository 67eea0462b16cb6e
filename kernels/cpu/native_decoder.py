"""The decoder's layer loop in one native call per forward pass (``kernels/cpu/native/decoder_loop.c``).

At batch 1 a layer's nine kernels take a few microseconds each, and the Python around each call
(the wrapper's checks, ctypes' argument conversions, a fresh output tensor) costs as much again:
some 300 calls a token on a 30-layer model. The loop calls the very kernels the Python loop calls
(function pointers from their loaded libraries, each its own per-instruction-set build), in the
same order, with the same arguments and thread count, so the hidden states are the Python loop's
bit for bit, for any batch.

``build`` makes the per-layer descriptors once (from the prepared linears' ``native_entry``);
``NativeDecoderLoop.run`` passes a step's metadata, and returns None for whatever the loop does not
take (the caller then runs the Python loop): kernels other than the native CPU bundle, one of those
switched off or falling back to torch, non-fp32 activations, caches that are not fp32 and
contiguous, an empty step. Everything the kernels index unchecked (positions, slots, block tables,
the query layout) is checked before any kernel runs, as the wrappers check it, and a bad entry
raises the wrappers' error: the shapes here, the values in C (a few integer compares at batch 1,
where the wrappers' torch reductions cost some 0.3 ms a step with the weights streaming through
the caches).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import os
from dataclasses import dataclass

import torch

from kernels.cpu import native_attention, native_build, native_elementwise, quant_int8act
from kernels.cpu.isa_choice import chosen_isa_in
from kernels.cpu.native_gemm import NativeEntry, fn_address

log = logging.getLogger(__name__)

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [
        ("fn", _P),
        ("packed", _P),
        ("bias", _P),
        ("n", _I64),
        ("k", _I64),
        ("code", _I32),
        ("coded", _I32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", _P),
        ("post_norm", _P),
        ("o_bias", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("attn_out_norm", _P),
        ("mlp_out_norm", _P),
        ("cos_sin", _P),
        ("window", _I64),
        ("group", _I64),
        ("softcap", _F32),
        ("down_glu", _P),
        ("mlp", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("rms_norm", _P),
        ("rotary_store_kv", _P),
        ("attention", _P),
        ("silu_and_mul", _P),
        ("cos_sin", _P),
        ("final_norm", _P),
        ("hidden", _I64),
        ("q_heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("inter", _I64),
        ("block_size", _I64),
        ("rotary_rows", _I64),
        ("num_blocks", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("gelu_and_mul", _P),
        ("mlp_min_rows", _I64),
    ]


_BUFFERS = ("residual", "normed", "qkv", "q", "attn", "hidden", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _I64),
        ("positions", _P),
        ("slots", _P),
        ("block_tables", _P),
        ("seq_lens", _P),
        ("query_start_loc", _P),
        ("block_table_stride", _I64),
        ("block_table_width", _I64),
        ("num_groups", _I64),
        ("slot_group_stride", _I64),
        ("table_group_stride", _I64),
        ("num_seqs", _I32),
        ("num_threads", _I32),
        ("x", _P),
        ("out", _P),
        *((name, _P) for name in _BUFFERS),
        ("progress", _P),
    ]


# The C structs each ctypes class above mirrors (decoder_loop.c's names): checked at load
# against the layout the library exports (``layout_mismatch``).
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "Linear": _Linear,
    "Layer": _Layer,
    "Model": _Model,
    "Step": _Step,
}


class _LayoutEntry(ctypes.Structure):  # decoder_loop.c's LayoutEntry: the table's one struct not checked
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _I64), ("size", _I64)]


def c_layout(lib) -> dict[str, dict[str | None, tuple[int, int]]]:
    """What the library says of its structs: per struct, ``None`` -> (0, its size) and each field
    -> (its offset, its size), as its compiler laid them out."""
    fn = lib.llmserve_decoder_loop_layout
    fn.argtypes, fn.restype = [], ctypes.POINTER(_LayoutEntry)
    table = fn()
    out: dict[str, dict[str | None, tuple[int, int]]] = {}
    i = 0
    while table[i].type is not None:
        e = table[i]
        field = None if e.field is None else e.field.decode()
        out.setdefault(e.type.decode(), {})[field] = (e.offset, e.size)
        i += 1
    return out


def layout_mismatch(c: dict, mirrors: dict[str, type[ctypes.Structure]]) -> str | None:
    """The first difference between the C side's layout ``c`` (``c_layout``) and the ctypes
    ``mirrors`` (C name -> class), naming the struct and field; None when every struct, field,
    offset and size agrees."""
    for name, mirror in mirrors.items():
        fields = c.get(name)
        if fields is None:
            return f"struct {name}: not in decoder_loop.c's layout table"
        mirrored = [f[0] for f in mirror._fields_]
        for field in mirrored:
            desc = getattr(mirror, field)
            if field not in fields:
                return f"{name}.{field}: in the ctypes mirror, not in decoder_loop.c's layout table"
            offset, size = fields[field]
            if (desc.offset, desc.size) != (offset, size):
                return (
                    f"{name}.{field}: offset {desc.offset}, {desc.size} bytes in the ctypes mirror; "
                    f"offset {offset}, {size} bytes in C"
                )
        for field in fields:
            if field is not None and field not in mirrored:
                return f"{name}.{field}: in decoder_loop.c, missing from the ctypes mirror"
        if ctypes.sizeof(mirror) != fields[None][1]:
            return (
                f"struct {name}: {ctypes.sizeof(mirror)} bytes in the ctypes mirror, {fields[None][1]} in C"
            )
    return None


_STAGES = {
    1: "the QKV GEMM",
    2: "paged attention",
    3: "the O GEMM",
    4: "the gate/up GEMM",
    5: "the down GEMM",
}
# Scratch rows kept between forwards up to this many tokens (a decode step's few, a chunk's
# hundreds); a longer prefill allocates its own, as the Python loop's temporaries would.
KEEP_SCRATCH_TOKENS = 512
_ALIGN = 16  # floats: each scratch buffer starts on a 64-byte line


def enabled() -> bool:
    """``LLMSERVE_NATIVE_DECODER_LOOP=0`` keeps the Python loop (comparisons, benchmarks)."""
    return os.environ.get("LLMSERVE_NATIVE_DECODER_LOOP", "1") != "0"


def fused_glu_enabled() -> bool:
    """``LLMSERVE_FUSED_GLU=0`` keeps the MLP's activation kernel apart from an int8-activation
    down projection (the same bits; for comparisons), read when the loop is built."""
    return os.environ.get("LLMSERVE_FUSED_GLU", "1") != "0"


# The rows from which a layer's MLP runs as one call (quant_int8act.c's llmserve_qi8_mlp) where
# gate/up and down are int8-activation linears. Measured on Qwen2.5-Coder-0.5B's MLP (RT, 2 threads,
# against gate/up then the SiLU-fused down; benchmarks.fusion_ab): 1.01-1.02x at 1,024 and 2,048
# rows, 0.92-1.00x at 1-512 (at one 512-row chunk its 76 items of 4 panels balance worse than the
# gate/up GEMM's 304 panels claimed in shrinking ranges).
MLP_MIN_ROWS = 1024


def fused_mlp_min_rows() -> int:
    """``LLMSERVE_FUSED_MLP_MIN_ROWS`` (default ``MLP_MIN_ROWS``); ``LLMSERVE_FUSED_MLP=0``: never.
    Read when the loop is built."""
    if os.environ.get("LLMSERVE_FUSED_MLP", "1") == "0":
        return -1
    return int(os.environ.get("LLMSERVE_FUSED_MLP_MIN_ROWS", MLP_MIN_ROWS))


def _mlp_entry(gate_up, down) -> int:
    """The address of the whole-MLP entry for these linears (``quant_int8act.fused_mlp_fn``), or 0
    where the loop does not take it (switched off, not both int8-activation linears of the loop's
    instruction set, row segments, an intermediate width not a multiple of 64)."""
    if fused_mlp_min_rows() < 0 or getattr(down, "isa", None) != native_build.chosen_isa():
        return 0
    fn = quant_int8act.fused_mlp_fn(gate_up, down)
    return 0 if fn is None else fn_address(fn)


def _glu_entry(down, gelu: bool) -> int:
    """The address of ``down``'s entry fused with the MLP's activation (``Int8ActLinear.glu_entry``),
    or 0 where the loop keeps them apart: switched off, no such entry, or the linear built for
    another instruction set than the activation kernel the loop would call (their bits are
    promised equal within one build's flags)."""
    method = getattr(type(down), "glu_entry", None)
    if method is None or not fused_glu_enabled() or getattr(down, "isa", None) != native_build.chosen_isa():
        return 0
    return method(down, gelu).fn


_CHECK_FAILED = -100  # decoder_loop.c: the step's metadata failed its check, nothing ran


def _raise_bad_metadata(what: int, value: int, model: _Model, qsl: torch.Tensor):
    """The error the kernel wrappers raise for the same input (decoder_loop.c's BAD_*)."""
    if what == -1:
        raise IndexError(f"rotary position {value} outside [0, {model.rotary_rows})")
    if what == -2:
        slots = model.num_blocks * model.block_size
        raise IndexError(f"cache slot {value} outside the cache's {slots} slots")
    if what == -3:
        raise IndexError(f"a context of {value} tokens overruns its block table")
    if what == -4:
        raise IndexError(f"block table entry {value} outside the cache's {model.num_blocks} blocks")
    raise ValueError(f"query_start_loc must rise from 0 to the step's query tokens, got {qsl.tolist()}")


@functools.cache
def _library(isa: str):
    lib = native_build.load_or_none("decoder_loop", isa)
    if lib is not None:
        fn = lib.llmserve_decoder_loop
        fn.argtypes, fn.restype = [_P, _P, _I64, _P, _P], _I32
    return lib


def library():
    return _library(native_build.chosen_isa())


@functools.cache
def _c_layout(isa: str) -> dict:
    return c_layout(_library(isa))


def layout_error() -> str | None:
    """Why the ctypes mirrors (``MIRRORS``) may not be passed to the chosen build (None: they may);
    logged once per difference found."""
    why = layout_mismatch(_c_layout(native_build.chosen_isa()), MIRRORS)
    if why is not None and why not in _layout_told:
        _layout_told.add(why)
        log.error("native decoder loop off: the ctypes structs differ from decoder_loop.c's: %s", why)
    return why


_layout_told: set[str] = set()


# Forwards run by the native loop, in this process (tests read it to see that the loop ran).
forwards = 0


@dataclass
class LayerParts:
    """What one decoder layer's loop iteration reads: the prepared projections (anything with a
    ``native_entry``; others, e.g. wrapped ones, keep the layer in Python) and its fp32 tensors."""

    qkv: object
    o: object
    gate_up: object
    down: object
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    o_bias: torch.Tensor | None
    # The declaration's optional parts (engine_svc/models/arch/): None where the layer has none.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None  # this layer's rotary table (None: the model's)
    window: int | None = None
    kv_group: int = 0  # its KV cache group (engine_svc/kv_groups.py)
    softcap: float | None = None  # its attention scores' tanh soft-cap (Gemma 2)


@dataclass(frozen=True)
class Shape:
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float
    gelu: bool = False  # the MLP's activation: GELU-tanh (else SiLU)


def _fp32_vector(t: torch.Tensor | None, n: int) -> bool:
    return t is not None and t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() and t.shape == (n,)


def _entry(proj, n: int, k: int) -> NativeEntry | None:
    method = getattr(type(proj), "native_entry", None)  # the class's: a wrapper's __getattr__ is no entry
    if method is None:
        return None
    e = method(proj)
    return e if (e.out_features, e.in_features) == (n, k) else None


def build(
    shape: Shape, layers: list[LayerParts], final_norm: torch.Tensor, cos_sin: torch.Tensor, progress: int = 0
):
    """The loop for these layers, or the reason (a string) it cannot run them. ``progress``: the
    address of an int64 the loop adds one to as each layer completes (0: none)."""
    if library() is None:
        return "no native build of decoder_loop"
    mismatch = layout_error()
    if mismatch is not None:
        return f"the ctypes structs differ from decoder_loop.c's: {mismatch}"
    h, d, inter = shape.hidden, shape.head_dim, shape.inter
    q_width = shape.q_heads * d
    if d % 16 or shape.kv_heads < 1 or shape.q_heads % shape.kv_heads:
        return f"head layout {shape.q_heads}/{shape.kv_heads} x {d} is not the native attention's"
    if not (cos_sin.dtype is torch.float32 and cos_sin.is_contiguous() and cos_sin.dim() == 2):
        return "the rotary table is not contiguous fp32"
    if cos_sin.shape[-1] != d or not _fp32_vector(final_norm, h):
        return "the rotary table or the final norm does not fit the model"
    descs = (_Layer * len(layers))()
    for i, (parts, desc) in enumerate(zip(layers, descs, strict=True)):
        widths = {
            "qkv": ((shape.q_heads + 2 * shape.kv_heads) * d, h),
            "o": (h, q_width),
            "gate_up": (2 * inter, h),
            "down": (h, inter),
        }
        for name, (n, k) in widths.items():
            e = _entry(getattr(parts, name), n, k)
            if e is None:
                return f"layer {i}'s {name} projection is not a native linear of [{n}, {k}]"
            bias = 0 if e.bias is None else e.bias
            coded = e.code is not None
            setattr(desc, name, _Linear(e.fn, e.packed, bias, n, k, e.code if coded else 0, int(coded)))
        if not (_fp32_vector(parts.input_norm, h) and _fp32_vector(parts.post_norm, h)):
            return f"layer {i}'s norms are not contiguous fp32 of {h}"
        if parts.o_bias is not None and not _fp32_vector(parts.o_bias, h):
            return f"layer {i}'s O bias is not contiguous fp32 of {h}"
        desc.input_norm, desc.post_norm = parts.input_norm.data_ptr(), parts.post_norm.data_ptr()
        desc.o_bias = None if parts.o_bias is None else parts.o_bias.data_ptr()
        if (parts.q_norm is None) != (parts.k_norm is None):
            return f"layer {i} has a q norm without a k norm or the reverse"
        for name, n in (("q_norm", d), ("k_norm", d), ("attn_out_norm", h), ("mlp_out_norm", h)):
            t = getattr(parts, name)
            if t is not None and not _fp32_vector(t, n):
                return f"layer {i}'s {name} is not contiguous fp32 of {n}"
            setattr(desc, name, None if t is None else t.data_ptr())
        table = parts.cos_sin
        if table is not None and not (
            table.dtype is torch.float32 and table.is_contiguous() and table.shape == cos_sin.shape
        ):
            return f"layer {i}'s rotary table is not contiguous fp32 of {tuple(cos_sin.shape)}"
        desc.cos_sin = None if table is None else table.data_ptr()
        if parts.window is not None and parts.window < 1:
            return f"layer {i}'s window {parts.window} is not a positive number of positions"
        desc.window = parts.window or 0
        if parts.softcap is not None and not parts.softcap > 0:
            return f"layer {i}'s attention soft-cap {parts.softcap} is not positive"
        desc.softcap = parts.softcap or 0.0
        desc.group = parts.kv_group
        desc.down_glu = _glu_entry(parts.down, shape.gelu) or None
        desc.mlp = _mlp_entry(parts.gate_up, parts.down) or None
    return NativeDecoderLoop(shape, layers, descs, final_norm, cos_sin, progress)


def _kernel_pointers(cache_dtype: torch.dtype = torch.float32, products: str = "float32") -> tuple | None:
    """The kernels the Python loop would run natively right now on caches of ``cache_dtype`` (the
    store and the attention for that dtype and ``products``: ``native_attention.build_name``); None
    where one of them would not be native: switched off, no build, a cache dtype without a kernel,
    or measured slower here."""
    if not native_elementwise.enabled() or not chosen_isa_in(native_elementwise.NATIVE_SILU):
        return None
    if not native_attention.enabled() or native_attention.build_name(cache_dtype, products) is None:
        return None
    elementwise = native_elementwise.library()
    attention = native_attention.library(None, cache_dtype, products)
    if elementwise is None or attention is None:
        return None
    seen = _pointers_seen.get((cache_dtype, products))
    if seen is None or seen[0] is not elementwise or seen[1] is not attention:
        names = (
            "llmserve_rms_norm_f32",
            native_elementwise.STORE_ENTRIES[cache_dtype],
            "llmserve_silu_and_mul_f32",
            "llmserve_gelu_tanh_and_mul_f32",
        )
        norm, store, silu, gelu = (fn_address(getattr(elementwise, n)) for n in names)
        pointers = (norm, store, fn_address(attention), silu, gelu)
        seen = _pointers_seen[(cache_dtype, products)] = (elementwise, attention, pointers)
    return seen[2]


_pointers_seen: dict = {}  # per cache dtype and products: the libraries last asked, and their entry points


# The bundles' attention entries this loop runs natively, and the products each forms.
_NATIVE_ATTENTION = {
    native_attention.paged_attention: "float32",
    native_attention.paged_attention_bf16_products: "bfloat16",
}


def _runs_native_kernels(k, gelu: bool = False) -> bool:
    """Whether ``k`` is the bundle whose kernels this loop calls (not the references, Triton, or
    a bundle with one replaced)."""
    return (
        k.rms_norm is native_elementwise.rms_norm
        and k.rotary_store_kv is native_elementwise.rotary_store_kv
        and k.paged_attention in _NATIVE_ATTENTION
        and k.silu_and_mul is native_elementwise.silu_and_mul
        and (not gelu or k.gelu_tanh_and_mul is native_elementwise.gelu_tanh_and_mul)
    )


class NativeDecoderLoop:
    def __init__(self, shape: Shape, layers: list[LayerParts], descs, final_norm, cos_sin, progress: int = 0):
        self.shape = shape
        self._parts = layers  # kept alive: the descriptors point into them
        self._groups = tuple(p.kv_group for p in layers) or (0,)
        self._descs = descs
        self._final_norm, self._cos_sin = final_norm, cos_sin
        self._model = _Model(
            hidden=shape.hidden,
            q_heads=shape.q_heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            inter=shape.inter,
            eps=shape.eps,
            scale=shape.scale,
            cos_sin=cos_sin.data_ptr(),
            final_norm=final_norm.data_ptr(),
            rotary_rows=cos_sin.shape[0],
            mlp_min_rows=max(fused_mlp_min_rows(), 1),
        )
        self._kernels: tuple | None = None
        self._caches: tuple = ()  # the cache tensors the descriptors point into
        self._cache_shape: tuple = ()
        self._step = _Step()
        self._step.progress = progress or None
        self._failure = (ctypes.c_int64 * 3)()
        self._scratch_tokens = 0
        self._scratch: torch.Tensor | None = None
        self._points_at_kept = False  # the step's buffer fields point into self._scratch
        s = shape
        d = s.head_dim
        self._widths = (
            s.hidden,
            s.hidden,
            (s.q_heads + 2 * s.kv_heads) * d,
            s.q_heads * d,
            s.q_heads * d,
            s.hidden,
            2 * s.inter,
            s.inter,
        )
        self._call = library().llmserve_decoder_loop
        self._args = (ctypes.byref(self._model), descs, len(layers), ctypes.byref(self._step), self._failure)

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the descriptors at this list's caches (each ``[2, blocks, block_size, kv_heads,
        head_dim]``, fp32, contiguous, all one shape); False where they are not that."""
        if len(kv_caches) == len(self._caches) and all(map(operator.is_, kv_caches, self._caches)):
            return True
        if len(kv_caches) != len(self._descs):
            return False
        first = kv_caches[0] if kv_caches else None
        shape = None if first is None else tuple(first.shape)
        s = self.shape
        if shape is None or len(shape) != 5 or shape[0] != 2 or shape[3:] != (s.kv_heads, s.head_dim):
            return False
        for cache, desc in zip(kv_caches, self._descs, strict=True):
            ok = cache.dtype in native_attention.BUILDS and cache.is_cpu and cache.is_contiguous()
            if not ok or tuple(cache.shape) != shape:
                self._caches = ()
                return False
            half = cache[0].numel() * cache.element_size()
            desc.k_cache, desc.v_cache = cache.data_ptr(), cache.data_ptr() + half
        self._caches, self._cache_shape = tuple(kv_caches), shape
        self._model.num_blocks, self._model.block_size = shape[1], shape[2]
        return True

    def _point_at_scratch(self, tokens: int) -> torch.Tensor:
        """Point the step's buffers (``_BUFFERS``) at scratch rows for ``tokens`` tokens: the kept
        scratch (grown to at most ``KEEP_SCRATCH_TOKENS``) or, past that, rows of this call's own.
        Returns the scratch, to hold for the call."""
        if self._points_at_kept and tokens <= self._scratch_tokens:
            return self._scratch
        keep = tokens <= max(self._scratch_tokens, KEEP_SCRATCH_TOKENS)
        if tokens <= self._scratch_tokens:
            scratch, cap = self._scratch, self._scratch_tokens
        else:
            cap = tokens
            per_token = sum(-(-w // _ALIGN) * _ALIGN for w in self._widths)
            scratch = torch.empty(cap * per_token + _ALIGN, dtype=torch.float32)
            if keep:
                self._scratch, self._scratch_tokens = scratch, cap
        base = scratch.data_ptr()
        base += -base % (4 * _ALIGN)
        for name, w in zip(_BUFFERS, self._widths, strict=True):
            setattr(self._step, name, base)
            base += 4 * cap * (-(-w // _ALIGN) * _ALIGN)
        self._points_at_kept = keep
        return scratch

    def run(self, k, x: torch.Tensor, positions: torch.Tensor, kv_caches, attn) -> torch.Tensor | None:
        """The final norm's output ``[T, hidden]`` for the embedded tokens ``x``, or None where the
        loop does not take this forward (then nothing was written)."""
        if not (_runs_native_kernels(k, self.shape.gelu) and enabled()):
            return None
        kernels = _kernel_pointers(
            kv_caches[0].dtype if kv_caches else torch.float32, _NATIVE_ATTENTION[k.paged_attention]
        )
        t = x.shape[0]
        grouped = attn.group_slots is not None
        slots = attn.group_slots if grouped else attn.slot_mapping
        groups = slots.shape[0] if grouped else 1
        h = self.shape.hidden
        if (
            kernels is None
            or t == 0
            or x.dtype is not torch.float32
            or not x.is_cpu
            or not x.is_contiguous()
            or x.shape != (t, h)
            or positions.dtype is not torch.int64
            or slots.dtype is not torch.int64
            or not positions.is_contiguous()
            or not slots.is_contiguous()
            or positions.shape != (t,)
            or slots.shape != ((groups, t) if grouped else (t,))
            or (grouped and groups <= max(self._groups))
            or not self._bind_caches(kv_caches)
        ):
            return None
        if kernels is not self._kernels:
            m = self._model
            m.rms_norm, m.rotary_store_kv, m.attention, m.silu_and_mul, gelu = kernels
            m.gelu_and_mul = gelu if self.shape.gelu else None
            self._kernels = kernels
        # The metadata's shapes here; its values (what the kernels index) in C, before any kernel.
        i32 = native_attention.as_int32
        tables, lens, qsl = i32(attn.block_tables), i32(attn.seq_lens), i32(attn.query_start_loc)
        native_attention.check_layout(tables, lens, qsl)
        if grouped:  # every group's tables, one after another, each laid out as group 0's
            tables = i32(attn.group_tables)
            if tables.dim() != 3 or tables.shape[0] != groups or tables.shape[1:] != attn.block_tables.shape:
                raise ValueError(f"group block tables of shape {tuple(tables.shape)} for {groups} groups")
        st = self._step
        st.num_groups = groups
        st.slot_group_stride = t if grouped else 0  # one table: every layer reads it
        st.table_group_stride = tables.stride(0) if grouped else 0
        out = torch.empty(t, h, dtype=torch.float32)
        st.tokens = t
        st.positions, st.slots = positions.data_ptr(), slots.data_ptr()
        st.block_tables, st.seq_lens, st.query_start_loc = tables.data_ptr(), lens.data_ptr(), qsl.data_ptr()
        st.block_table_stride = tables.stride(-2)
        st.block_table_width = tables.shape[-1]
        st.num_seqs = lens.shape[0]
        st.num_threads = torch.get_num_threads()
        st.x, st.out = x.data_ptr(), out.data_ptr()
        scratch = self._point_at_scratch(t)
        rc = self._call(*self._args)
        del scratch
        if rc == _CHECK_FAILED:
            _raise_bad_metadata(self._failure[1], self._failure[2], self._model, qsl)
        if rc != 0:
            layer, stage, code = self._failure
            raise RuntimeError(
                f"native decoder loop: {_STAGES.get(stage, stage)} refused in layer {layer} ({code})"
            )
        global forwards
        forwards += 1
        return out
