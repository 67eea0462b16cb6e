"""The engine process's own options. The engine's CLI takes them, and the launcher (``llmserve
serve``) accepts the same flags and passes them on to the engine it starts."""

from __future__ import annotations

import argparse

ENGINE_OPTIONS = [  # (flag, type, help); None type: a switch; "list": one or more strings; "bytes": a size
    ("--load-format", str, "'auto' (safetensors) or 'dummy' (random weights from config.json)"),
    ("--block-size", int, "KV cache block size in tokens"),
    ("--num-kv-blocks", int, "KV cache size in blocks (default: what the KV memory budget holds)"),
    (
        "--kv-cache-memory",
        "bytes",
        "KV cache size in bytes (suffixes K, M, G: 8G; default: on CPU half the memory available at "
        "start, lazily backed; on CUDA the device's free memory less a tenth of its total)",
    ),
    ("--max-num-seqs", int, "most sequences running at once (each holds its KV blocks)"),
    (
        "--max-seqs-per-step",
        int,
        "most running sequences one step computes (default: on CPU 16 per engine thread, at least 16; "
        "on CUDA all that run); when more run, the step's seats go round the clients, least recently "
        "stepped first",
    ),
    (
        "--max-num-batched-tokens",
        int,
        "token budget of one step; its work budget is what that many prompt tokens cost at depth 0",
    ),
    (
        "--attention-work-ratio",
        float,
        "attention work per context token over a token's linear work, for the step's work budget "
        "(default: from the model's config; 0: tokens alone)",
    ),
    (
        "--decode-stall-factor",
        float,
        "while sequences decode, a step with prompt chunks costs at most this many times their decode "
        "step alone, by the work rule (default: off; 3 keeps streams within about 3x)",
    ),
    ("--max-model-len", int, "context length (default: the model's)"),
    ("--no-prefix-caching", None, "turn prefix caching off"),
    ("--dtype", str, "auto (default: on CPU a bf16/fp16 checkpoint as stored), float32, float16, bfloat16"),
    (
        "--kv-cache-dtype",
        str,
        "what the KV cache holds: auto (default: the activations' dtype, float32 on CPU), float32, or "
        "bfloat16 on CPU (half the bytes a token: twice the context in the same memory, faster decodes "
        "at depth; each K/V value rounded to nearest even as it is stored)",
    ),
    (
        "--attention-dtype",
        str,
        "attention's products on CPU: auto (default: float32, exact on the cache's values) or bfloat16 "
        "(queries and softmax weights rounded to bf16, VDPBF16PS where the CPU has AVX512-BF16: faster "
        "at depth, other bits than float32's; a bf16 KV cache)",
    ),
    (
        "--linear-dtype",
        str,
        "the linears' products on CPU: auto (default: float32, exact on the weights as loaded) or "
        "bfloat16 (a bf16 checkpoint's activations rounded to bf16 in its GEMMs, VDPBF16PS where the "
        "CPU has AVX512-BF16: ~2x the batched GEMMs, other bits than float32's, as vLLM computes)",
    ),
    ("--device", str, "cpu or cuda"),
    (
        "--quantization",
        str,
        "weights of the linears: auto (a GGUF file's Q8_0/Q4_0/Q4_1 blocks as stored, unless --dtype), "
        "none, gguf, int8 or int4 (blocks made at load; docs/quantization.md)",
    ),
    (
        "--quantized-activations",
        str,
        "activations of the quantized linears: auto (the default, int8), int8 (quantized per call in "
        "blocks of 32, integer dot products, as llama.cpp) or none (fp32: the dequantized model's "
        "math bit for bit)",
    ),
    ("--seed", int, "engine seed"),
    ("--scheduling-policy", str, "fcfs or priority"),
    (
        "--speculative-config",
        str,
        'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 4}\' (k is also the cap: no request drafts more per step)',
    ),
    ("--enable-lora", None, "serve LoRA adapters (loaded with --lora-modules or the Adapters RPCs)"),
    ("--max-loras", int, "LoRA adapter slots on the device: distinct adapters one step runs (default 1)"),
    ("--max-lora-rank", int, "largest LoRA rank accepted (default 16)"),
    ("--lora-modules", "list", "LoRA adapters loaded at start, as name=path (PEFT directories)"),
    (
        "--kv-offload-bytes",
        "bytes",
        "host-memory tier of the prefix cache under the KV pool, in bytes (suffixes K, M, G: 4G): blocks "
        "the pool evicts spill there (default: 4G, at most a quarter of the RAM, on CUDA; 0 on CPU, "
        "where the pool is host memory already)",
    ),
    (
        "--kv-disk-bytes",
        "bytes",
        "disk tier of the prefix cache, in bytes (suffixes K, M, G; 0: off; default 4G, at most a "
        "quarter of the disk's free space): computed blocks are written through to it, checked when "
        "read back, and kept across restarts",
    ),
    ("--kv-disk-dir", str, "the disk tier's directory (default: $LLMSERVE_CACHE/kv or ~/.cache/llmserve/kv)"),
    (
        "--torch-threads",
        int,
        "the engine's CPU threads, torch's and the native kernels' (default: every CPU this process "
        "may use, within its container's CPU limit)",
    ),
    (
        "--watchdog-timeout",
        float,
        "seconds without a completed step, or a completed layer of the step in progress, while work "
        "is pending before the engine ends its sessions and refuses work (0: off; default 30)",
    ),
]


def parse_bytes(text: str) -> int:
    """A size in bytes: a whole number, optionally with K, M or G (powers of 1024; KiB, MB... too)."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4096, 512M, 4G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size in bytes must be >= 0, got {text!r}")
    return value


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's own options; the launcher (llmserve serve) accepts and passes on the same flags."""
    g = p.add_argument_group("engine")
    for flag, kind, help_ in ENGINE_OPTIONS:
        if kind is None:
            g.add_argument(flag, action="store_true", help=help_)
        elif kind == "list":
            g.add_argument(flag, nargs="+", help=help_)
        elif kind == "bytes":
            g.add_argument(flag, type=parse_bytes, help=help_)
        else:
            g.add_argument(flag, type=kind, help=help_)


def engine_options_argv(args) -> list[str]:
    out = []
    for flag, kind, _ in ENGINE_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kind is None and value:
            out.append(flag)
        elif kind == "list" and value:
            out += [flag, *value]
        elif kind is not None and kind != "list" and value is not None:
            out += [flag, str(value)]
    return out
