"""One rank's runtime: the model as loaded and what the load decided, the kernels, the KV cache, the
LoRA wrapping and the forward pass over them. Built the same way by the engine (rank 0, and its
draft model) and by every tensor-parallel worker (ranks 1..N-1), so a rank is written once."""

from __future__ import annotations

import torch

from engine_svc.config import EngineConfig
from engine_svc.lora.layers import LoRAStep, wrap_lora_layers
from engine_svc.model_runner import ModelForward
from engine_svc.model_setup import allocate_kv_caches, load_model, resolve_kv_cache_dtype
from engine_svc.models.model_path import resolve_model_path
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard
from kernels.backend import Kernels, select_kernels
from kernels.cpu import native_gemm

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str | None, rank: int = 0) -> torch.device:
    if name is None or name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank)  # one GPU per tensor-parallel rank
    return device


def resolve_max_model_len(spec: ModelSpec, config: EngineConfig) -> int:
    limit = spec.max_position_embeddings
    if spec.sliding_window:  # a window the declaration does not serve per layer: stay inside it
        limit = min(limit, spec.sliding_window)
    wanted = config.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's limit {limit}")
    return wanted


def resolve_dtype(name: str | None, device: torch.device, config: EngineConfig | None = None) -> torch.dtype:
    """``auto`` (or unset): bf16 on CUDA. On a CPU, a bf16 or fp16 checkpoint's own dtype where the
    native GEMM serves it (its weights kept 16-bit and widened exactly in registers, fp32 between the
    ops: the result is the fp32 run on the same weights, at half the bytes), on every instruction
    set it measured faster on, AVX2 included; else float32 (a GGUF file's float tensors, an fp32
    checkpoint, a linear backend or quantization asked for that runs only in fp32)."""
    if name is None or name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        stored = DTYPES.get(_stored_dtype(config) or "")
        if stored in (torch.bfloat16, torch.float16) and _native_half_serves(stored, config):
            return stored
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


def _stored_dtype(config: EngineConfig | None) -> str | None:
    if config is None or config.load_format == "dummy":
        return None
    try:
        return resolve_model_path(config.model).stored_dtype
    except (OSError, ValueError):
        return None


def _native_half_serves(dtype: torch.dtype, config: EngineConfig) -> bool:
    """The 16-bit weights run on the native GEMM: nothing asked for another linear path or for
    quantized weights, and the GEMM builds (and measured faster than oneDNN) here."""
    if config.linear_backend not in (None, "auto", "native"):
        return False
    if config.quantization not in (None, "auto", "none"):
        return False
    return native_gemm.unusable_reason(dtype) is None


class RankRuntime:
    """Rank ``rank`` of ``config.tensor_parallel_size``: its shard of the model, loaded on
    construction; the KV cache (``allocate_kv_caches``, once the block count is known) and the
    LoRA wrapping (``wrap_lora``) follow, then ``forward()`` runs steps over them.

    ``spec`` and ``max_model_len``: what the caller resolved already (the engine refuses
    untested features before the load; a draft model takes the target's context), else resolved
    here from ``config``. ``seed``: torch's global RNG seeded from ``config.seed`` before the load
    (a draft model's load leaves it where the target's left it). ``kernels``: a bundle already
    selected (else selected here)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        *,
        spec: ModelSpec | None = None,
        max_model_len: int | None = None,
        seed: bool = True,
        kernels: Kernels | None = None,
    ):
        self.config = config
        self.shard = Shard(rank, config.tensor_parallel_size)
        self.device = resolve_device(config.device, rank)
        self.dtype = resolve_dtype(config.dtype, self.device, config)  # the weights' dtype as asked
        self.spec = spec if spec is not None else ModelSpec.from_path(config.model)
        self.max_model_len = max_model_len or resolve_max_model_len(self.spec, config)
        if seed:
            torch.manual_seed(config.seed)
        self.model, self.load = load_model(
            config, self.spec, self.dtype, self.device, self.max_model_len, self.shard
        )
        self.kernels = (
            kernels
            if kernels is not None
            else select_kernels(self.device, config.kernel_backend, config.attention_dtype)
        )
        self.kv_caches: list[torch.Tensor] = []
        self.lora_step: LoRAStep | None = None

    @property
    def activation_dtype(self) -> torch.dtype:
        """What flows between the ops, and what the KV cache and LoRA slots hold."""
        return self.load.activation_dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the KV cache holds (``config.kv_cache_dtype``; ``model_setup.resolve_kv_cache_dtype``)."""
        name = self.config.kv_cache_dtype
        if self.config.attention_dtype == "bfloat16" and name in (None, "auto"):
            name = "bfloat16"  # bf16 products read a bf16 cache
        return resolve_kv_cache_dtype(name, self.activation_dtype, self.device)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """This rank's KV cache of ``num_blocks`` blocks (``model_setup.allocate_kv_caches``)."""
        self.kv_caches = allocate_kv_caches(
            self.spec, self.shard, num_blocks, self.config.block_size, self.kv_cache_dtype, self.device
        )
        return self.kv_caches

    def wrap_lora(self) -> LoRAStep:
        """Wrap the model's projections for adapters (``lora.layers``); the step each forward's
        adapter mapping is put on."""
        self.lora_step = wrap_lora_layers(self.model)
        return self.lora_step

    def forward(self) -> ModelForward:
        """The forward pass over this rank's model, kernels, KV cache and LoRA wrapping."""
        return ModelForward(self.model, self.kernels, self.kv_caches, self.device, self.lora_step)
