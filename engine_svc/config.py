"""Engine configuration (what a caller chooses) and model facts (what the checkpoint says)."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULING_POLICIES = ("fcfs", "priority")
# kv_cache_dtype's values (None: "auto"); the short names are aliases.
KV_CACHE_DTYPES = (None, "auto", "float32", "fp32", "bfloat16", "bf16")
# attention_dtype's values (None: "auto", fp32 products).
ATTENTION_DTYPES = (None, "auto", "float32", "bfloat16")
LINEAR_DTYPES = (None, "auto", "float32", "bfloat16")
MAX_LORAS = 256
MAX_LORA_RANK = 512


# A step's seats on CPU when max_seqs_per_step is not set (docs/slow-readers.md#measured): this many
# per engine thread, and at least the floor. The bound kept: a normal 16-token request beside 300
# never-read streams of another client stays within issue 37's 2 s on the default model (2 threads:
# 0.5 / 0.9 / 1.6-2.3 s at 16 / 32 / 64 seats), while batched GEMMs still gain from more rows
# (Qwen2.5-Coder-0.5B Q4_K_M, 64 streams decoding: 313 / 404 / 458 tok/s at 16 / 32 / 64 seats).
CPU_SEQS_PER_STEP_PER_THREAD = 16
CPU_MIN_SEQS_PER_STEP = 16


@dataclass
class EngineConfig:
    model: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes for the whole KV cache
    max_num_seqs: int = 256
    # Most running sequences one step computes (None: max_num_seqs on CUDA, fewer on CPU: above).
    # When more may run, the step's seats go round the clients (Request.client), each client's
    # least recently stepped first: hundreds of streams from one client cannot make every step of
    # another client's stream slow.
    max_seqs_per_step: int | None = None
    max_num_batched_tokens: int = 2048
    # While sequences decode, a step that also computes prompt chunks costs at most this many times
    # their decode step alone (step_cost.py: the work rule plus the step's fixed cost), so that
    # streams keep their inter-token latency while a long prompt is prefilled. None or 0: off (a
    # prompt chunk takes the whole work budget); 3 keeps them within about 3x.
    decode_stall_factor: float | None = None
    # The step's work budget (engine_svc/step_cost.py): attention work per context token relative
    # to a token's linear work. None: derived from the model's config; 0: tokens alone count.
    attention_work_ratio: float | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str | None = None  # None: fp32 on CPU, bf16 on CUDA
    # What the KV cache holds: None/"auto" the activations' dtype (fp32 on CPU); "bfloat16" on CPU
    # half the bytes a token (each K/V value rounded to nearest even as it is stored, widened
    # exactly as attention reads it: docs/serving.md#kv-cache-dtype). On CUDA only the activations'.
    kv_cache_dtype: str | None = None
    # What attention's products are formed in, on CPU: None/"auto"/"float32" exactly from the cache's
    # values; "bfloat16" each query and softmax weight rounded to bf16 and the products summed in
    # pairs (VDPBF16PS where the CPU has AVX512-BF16): a bf16 KV cache (kv_cache_dtype unset or
    # "bfloat16"), faster attention at depth, other bits (docs/serving.md#attention-dtype).
    attention_dtype: str | None = None
    # What the linears' products are formed in, on CPU: None/"auto"/"float32" fp32 activations on the
    # weights as loaded (a bf16 checkpoint's: HF's fp32 forward on them, exactly); "bfloat16" each
    # activation rounded to bf16 and the products summed in pairs (VDPBF16PS where the CPU has
    # AVX512-BF16), on a bf16 checkpoint's weights: vLLM's arithmetic, ~2x the batched GEMMs, other
    # bits (docs/serving.md#linear-dtype).
    linear_dtype: str | None = None
    device: str | None = None  # None: cuda when available, else cpu
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights from config.json)
    seed: int = 0
    kernel_backend: str | None = None  # None/"auto": triton on CUDA, torch elsewhere
    linear_backend: str | None = None  # None/"auto": native GEMM or oneDNN on CPU, else F.linear
    # None/"auto": a GGUF file's Q8_0/Q4_0/Q4_1 blocks kept (CPU, no float dtype asked for), else as
    # loaded; "none"; "gguf"; "int8" / "int4": blocks made at load (docs/quantization.md)
    quantization: str | None = None
    # Activations of the quantized linears: "int8" (quantized per call in blocks of 32, integer dot
    # products as llama.cpp), "none" (fp32, bit-equal to the dequantized fp32 model); None/"auto":
    # the measured default (docs/quantization.md). Fixed per engine, never per batch.
    quantized_activations: str | None = None
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    max_logprobs: int = 20
    gpu_memory_utilization: float = 0.9
    speculative_config: dict | None = None  # e.g. {"method": "ngram", "num_speculative_tokens": 4}
    enable_lora: bool = False
    max_loras: int = 1  # adapter slots on the device: distinct adapters one step can run
    max_lora_rank: int = 16
    lora_modules: dict[str, str] | None = None  # name -> PEFT adapter directory, loaded at start
    # The prefix cache's tiers below the KV pool (docs/prefix-caching.md#tiers): blocks the pool
    # evicts spill to host memory (kv_offload_bytes; None: 4 GiB, at most a quarter of the RAM, on
    # CUDA; 0 on CPU, where the pool is host memory already), whose overflow goes to disk
    # (kv_disk_bytes under kv_disk_dir; None: $LLMSERVE_CACHE/kv or ~/.cache/llmserve/kv). The
    # disk tier outlives the engine. 0 turns a tier off; kv_disk_bytes None is the default size
    # (kv_tiers/setup.py: 4 GiB, at most a quarter of the disk's free space). The library's default
    # keeps the disk off, the server's (llmserve serve) is None: on.
    kv_offload_bytes: int | None = None
    kv_disk_bytes: int | None = 0
    kv_disk_dir: str | None = None

    def validate(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        factor = self.decode_stall_factor
        if factor is not None and not (factor == 0 or 1 < factor < float("inf")):
            raise ValueError(f"decode_stall_factor must be 0 (off) or a number > 1, got {factor!r}")
        if self.max_seqs_per_step is not None and self.max_seqs_per_step < 1:
            raise ValueError(f"max_seqs_per_step must be >= 1, got {self.max_seqs_per_step}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        ratio = self.attention_work_ratio
        if ratio is not None and not (isinstance(ratio, int | float) and 0 <= ratio < float("inf")):
            raise ValueError(f"attention_work_ratio must be a finite number >= 0, got {ratio!r}")
        for name in ("kv_offload_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a whole number of bytes >= 0, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}"
            )
        if self.linear_backend not in (None, "auto", "native", "onednn", "dense"):
            raise ValueError(
                f"linear_backend must be 'auto', 'native', 'onednn' or 'dense', got {self.linear_backend!r}"
            )
        if self.quantization is not None:
            from engine_svc.models.quantized_weights import QUANTIZATIONS

            if self.quantization not in ("auto", *QUANTIZATIONS):
                raise ValueError(
                    f"quantization must be one of {('auto', *QUANTIZATIONS)}, got {self.quantization!r}"
                )
            if self.quantization not in ("auto", "none") and self.dtype not in (None, "float32", "fp32"):
                raise ValueError(
                    f"quantization={self.quantization!r} runs fp32 activations: dtype must be unset or "
                    f"float32, got {self.dtype!r}"
                )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES[1:]}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(
                f"attention_dtype must be one of {ATTENTION_DTYPES[1:]}, got {self.attention_dtype!r}"
            )
        if self.attention_dtype == "bfloat16" and self.kv_cache_dtype not in (
            None,
            "auto",
            "bfloat16",
            "bf16",
        ):
            raise ValueError(
                "attention_dtype='bfloat16' reads a bf16 KV cache: kv_cache_dtype must be unset, 'auto' or "
                f"'bfloat16', got {self.kv_cache_dtype!r}"
            )
        if self.linear_dtype not in LINEAR_DTYPES:
            raise ValueError(f"linear_dtype must be one of {LINEAR_DTYPES[1:]}, got {self.linear_dtype!r}")
        if self.quantized_activations not in (None, "auto", "int8", "none"):
            raise ValueError(
                f"quantized_activations must be 'auto', 'int8' or 'none', got {self.quantized_activations!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._validate_lora()
        from engine_svc.spec_decode.config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)

    def _validate_lora(self) -> None:
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"max_loras must be in [1, {MAX_LORAS}], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")


@dataclass
class ModelInfo:
    """What a client needs to know about the served model and the limits the engine enforces."""

    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    max_logprobs: int = 20
    architectures: list[str] = field(default_factory=list)
