"""The GPU verification, in one run: ``python -m scripts.gpu_check --out DIR`` (``make gpu-check OUT=DIR``).

For a machine with an NVIDIA GPU (H100/H200 class); finishes in under 8 minutes and writes
``DIR/gpu_check.json`` after every section, so a run cut short still leaves what it measured:

1. ``kernels``: every Triton kernel against its torch reference on CUDA, bf16 and fp16, on the
   cases the CPU tests run under the interpreter (``tests.kernel_cases``).
2. ``attention_vs_sdpa``: paged attention time over ``scaled_dot_product_attention`` time on the
   same contiguous K/V (causal prefill and a decode batch).
3. ``decode_bandwidth``: the decode path's achieved memory bandwidth as a fraction of the peak
   (from ``PEAK_BANDWIDTH_TBPS`` by device name, or ``--peak-bandwidth-tbps``).
4. ``tiny_hf_equality``: the engine's greedy tokens (Triton kernels, fp32) equal HF ``generate`` on
   the GPU for a small random Llama, a small random Gemma 2 (sliding windows, soft-capped scores) and
   a small random Gemma 3 (5:1 local/global, a rotary base per kind, q/k norms).
5. ``lora``: the batched LoRA kernel against its torch twin in bf16/fp16; a batch mixing the base
   and three adapters (ranks 4-16, different target sets, on two slots: swaps) gives the same
   greedy tokens (fp32) with the Triton kernels as with the torch twins; and, on a 1B-class model
   with dummy weights in bf16, output tokens/s of requests over four rank-16 adapters vs the base
   and mixed-adapter steps vs each adapter's requests in a batch of their own.
6. ``llama3_8b``: a Llama-3-8B-shaped model with ``load_format="dummy"`` in bf16: batch-1 decode
   time per token against the bandwidth floor (weight bytes / peak), and output tokens/s for
   ``--requests`` requests of mixed lengths.

Argument parsing, the peak table and the model configs are plain Python, tested on CPU
(tests/test_gpu_check.py); everything that needs the GPU is inside the section functions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

SECTIONS = ("kernels", "attention_vs_sdpa", "decode_bandwidth", "tiny_hf_equality", "lora", "llama3_8b")

# Peak HBM bandwidth in TB/s by device name, most specific names first (first substring match wins).
PEAK_BANDWIDTH_TBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", 3.35),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("A10G", 0.6),
    ("L4", 0.3),
)

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    p.add_argument(
        "--peak-bandwidth-tbps",
        type=float,
        default=None,
        help="device peak memory bandwidth, TB/s (default: looked up by device name)",
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run")
    p.add_argument("--requests", type=int, default=256, help="requests in the throughput run")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed at batch 1")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=450.0,
        help="sections not yet started when this much time has passed are skipped",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests < 1 or args.decode_steps < 1:
        p.error("--requests and --decode-steps must be >= 1")
    if args.peak_bandwidth_tbps is not None and args.peak_bandwidth_tbps <= 0:
        p.error("--peak-bandwidth-tbps must be > 0")
    return args


def peak_bandwidth(device_name: str, override_tbps: float | None = None) -> tuple[float | None, str]:
    """(bytes/s, where the number came from); (None, "unknown") for a device not in the table."""
    if override_tbps is not None:
        return override_tbps * 1e12, "--peak-bandwidth-tbps"
    for key, tbps in PEAK_BANDWIDTH_TBPS:
        if key.lower() in device_name.lower():
            return tbps * 1e12, f"table: {key}"
    return None, "unknown"


def parameter_count(cfg: dict) -> int:
    h, i, v, layers = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["num_hidden_layers"],
    )
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    hq, hk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * (hq + 2 * hk) * d + hq * d * h + 3 * h * i + 2 * h
    lm_head = 0 if cfg.get("tie_word_embeddings") else v * h
    return v * h + layers * per_layer + h + lm_head


def decode_floor_seconds(cfg: dict, dtype_bytes: int, peak_bytes_per_s: float) -> dict:
    """Lower bounds for one batch-1 decode step: every weight read once (the embedding table
    included, as the issue defines it, and without it, since a step reads one row of it)."""
    total = parameter_count(cfg) * dtype_bytes
    embed = cfg["vocab_size"] * cfg["hidden_size"] * dtype_bytes
    return dict(
        weight_bytes=total,
        floor_s=total / peak_bytes_per_s,
        floor_s_without_embedding=(total - embed) / peak_bytes_per_s,
    )


def write_config_only_model(out_dir: Path, cfg: dict) -> Path:
    """A model folder with config.json and generation_config.json only, for ``load_format="dummy"``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {
        "eos_token_id": cfg.get("eos_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir


def mixed_requests(
    n: int, seed: int, vocab_size: int, prompt_range=(16, 1024), output_range=(16, 256)
) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs with lengths drawn uniformly from the ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(10, vocab_size) for _ in range(rng.randint(*prompt_range))]
        out.append((prompt, rng.randint(*output_range)))
    return out


# --- sections (need torch; the GPU ones need CUDA) ---------------------------------------------


def section_kernels(device: str) -> dict:
    import torch

    from kernels.backend import select_kernels
    from tests import kernel_conformance as conformance

    records = conformance.check_all(select_kernels(device, "triton"), device, (torch.bfloat16, torch.float16))
    failed = [r for r in records if not r["ok"]]
    return dict(passed=len(records) - len(failed), failed=len(failed), all_ok=not failed, records=records)


def section_attention_vs_sdpa(device: str) -> dict:
    import torch

    from benchmarks import kernel_microbench as microbench
    from kernels.backend import select_kernels

    attn = select_kernels(device, "triton").paged_attention
    shapes = [
        dict(batch=4, seq_len=2048, q_len=2048, hq=32, hk=8, d=128),  # causal prefill, Llama-3-8B heads
        dict(batch=8, seq_len=1024, q_len=1024, hq=32, hk=32, d=64),  # MHA, head dim 64
        dict(batch=64, seq_len=2048, q_len=1, hq=32, hk=8, d=128),  # decode batch
    ]
    runs = [
        microbench.attention_vs_sdpa(attn, **s, block_size=16, dtype=torch.bfloat16, device=device)
        for s in shapes
    ]
    return dict(runs=runs)


def section_decode_bandwidth(device: str, peak: float | None) -> dict:
    import torch

    from benchmarks import kernel_microbench as microbench
    from kernels.backend import select_kernels

    attn = select_kernels(device, "triton").paged_attention
    shapes = [
        dict(batch=64, seq_len=4096, block_size=16),  # many requests: the varlen kernel fills the device
        dict(batch=8, seq_len=8192, block_size=16),  # few, long: split-KV
        dict(batch=1, seq_len=32768, block_size=32),  # one very long context: split-KV
    ]
    runs = [
        microbench.decode_bandwidth(
            attn, **s, hq=32, hk=8, d=128, dtype=torch.bfloat16, device=device, peak_bytes_per_s=peak
        )
        for s in shapes
    ]
    return dict(runs=runs, best_fraction_of_peak=max((r["fraction_of_peak"] or 0.0) for r in runs) or None)


def release_gpu_memory() -> None:
    """Free what finished engines held (their reference cycles first), before the next one sizes
    its KV cache from the memory left."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# The tiny random models the HF-equality section serves with the Triton kernels: a Llama, and a
# Gemma 2 (sliding-window layers alternating with global ones, soft-capped attention scores: the
# kernels' per-layer window and cap; HF's eager attention is the one that applies the cap).
TINY_HF_MODELS = {
    "llama": (
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024),
        {},
    ),
    "gemma2": (
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=1024,
            sliding_window=48,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,
        ),
        dict(attn_implementation="eager"),
    ),
    # Gemma 3: five sliding-window layers to one global (the default pattern, 7 layers: 0-4 and 6
    # local), a rotary base per kind (10k local, 1M global), q/k RMSNorm, a tied head.
    "gemma3": (
        dict(
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=1024,
            sliding_window=48,
            query_pre_attn_scalar=64,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
        {},
    ),
}


def section_tiny_hf_equality(
    device: str,
    workdir: Path,
    seed: int,
    prompt_lengths: tuple[int, ...] = (1, 7, 33, 100, 300, 700),
    archs: tuple[str, ...] = ("llama", "gemma2", "gemma3"),
) -> dict:
    """Per architecture of ``TINY_HF_MODELS``, the engine's greedy tokens (Triton kernels, fp32)
    against HF ``generate``; the Llama's result at the top level, as before."""
    by_arch = {arch: _tiny_hf_equality(device, workdir, seed, prompt_lengths, arch) for arch in archs}
    first = by_arch[archs[0]]
    return dict(
        all_equal=all(r["all_equal"] for r in by_arch.values()),
        prompts=first["prompts"],
        archs={a: r for a, r in by_arch.items() if a != archs[0]},
    )


def _tiny_hf_equality(
    device: str, workdir: Path, seed: int, prompt_lengths: tuple[int, ...], arch: str
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine_svc import LLM, SamplingParams
    from engine_svc.models.build import build_random_model

    shape, hf_options = TINY_HF_MODELS[arch]
    model_dir = build_random_model(
        workdir / f"tiny_{arch}",
        arch,
        seed=seed,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        **shape,
    )
    max_new = 16
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in prompt_lengths]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **hf_options).to(device).eval()
    llm = LLM(
        model=str(model_dir),
        device=device,
        dtype="float32",
        kernel_backend="triton",
        block_size=16,
        max_num_batched_tokens=128,
    )
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True), use_tqdm=False
    )
    results = []
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        ref = ref[0, len(prompt) :].tolist()
        got = out.outputs[0].token_ids
        entry = dict(prompt_len=len(prompt), equal=got == ref)
        if got != ref:  # HF's own top-2 gap where they part: below ~1e-4 it is arithmetic, above a bug
            pos = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), 0)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ref[:pos]], device=device)).logits[0, -1].float()
            top2 = logits.topk(2).values
            entry.update(first_difference=pos, hf_top2_gap=float(top2[0] - top2[1]), engine=got, hf=ref)
        results.append(entry)
    return dict(all_equal=all(r["equal"] for r in results), prompts=results)


def section_llama3_8b(
    device: str,
    workdir: Path,
    peak: float | None,
    num_requests: int,
    decode_steps: int,
    seed: int,
    cfg: dict = LLAMA3_8B,
    kernel_backend: str = "triton",
    prompt_range=(16, 1024),
    output_range=(16, 256),
    **engine_options,
) -> dict:
    """Batch-1 decode and mixed-request throughput of a config-only model with dummy weights."""
    from engine_svc import LLM, SamplingParams

    model_dir = write_config_only_model(workdir / "config_only_model", cfg)
    options = dict(
        max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=4096, enable_prefix_caching=False
    )
    options.update(engine_options)
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        device=device,
        kernel_backend=kernel_backend,
        **options,
    )
    result: dict = dict(engine_start_s=time.perf_counter() - t0, weight_bytes=parameter_count(cfg) * 2)
    greedy = dict(temperature=0.0, ignore_eos=True)
    # A short mixed warm-up first, so Triton's compilation is not timed.
    warm = mixed_requests(8, seed + 1, cfg["vocab_size"], (8, min(600, prompt_range[1])), (4, 8))
    llm.generate(
        [p for p, _ in warm], [SamplingParams(max_tokens=n, **greedy) for _, n in warm], use_tqdm=False
    )

    result["batch1_decode"] = _batch1_decode(llm.engine, cfg, decode_steps, seed, peak)
    reqs = mixed_requests(num_requests, seed, cfg["vocab_size"], prompt_range, output_range)
    t0 = time.perf_counter()
    outs = llm.generate(
        [p for p, _ in reqs], [SamplingParams(max_tokens=n, **greedy) for _, n in reqs], use_tqdm=False
    )
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    result["throughput"] = dict(
        requests=num_requests,
        prompt_tokens=prompt_tokens,
        output_tokens=produced,
        expected_output_tokens=sum(n for _, n in reqs),
        seconds=elapsed,
        output_tokens_per_s=produced / elapsed,
        total_tokens_per_s=(produced + prompt_tokens) / elapsed,
    )
    return result


LORA_MODEL = dict(
    LLAMA3_8B,
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
)


def section_lora(
    device: str,
    workdir: Path,
    seed: int,
    kernel_backend: str = "triton",
    dtypes: tuple | None = None,
    perf_cfg: dict = LORA_MODEL,
    perf_requests: int = 64,
    perf_lengths: tuple[int, int] = (128, 128),
    prompt_lengths: tuple[int, ...] = (5, 40, 17, 90, 3, 33, 61, 8),
    max_tokens: int = 12,
) -> dict:
    import torch

    from benchmarks.random_adapter import write_random_adapter
    from engine_svc import LLM, LoRARequest, SamplingParams
    from engine_svc.models.build import build_random_model
    from kernels.backend import select_kernels
    from tests import kernel_conformance as conformance

    kernels = select_kernels(device, kernel_backend)
    records = []
    for dtype in dtypes or (torch.bfloat16, torch.float16):
        records += conformance.check_lora(kernels, device, dtype)
    result: dict = dict(kernel_records=records, kernels_ok=all(r["ok"] for r in records))

    # Equality: the Triton forward and the torch twin's, same device, same mixed batch (fp32).
    model_dir = build_random_model(
        workdir / "lora_llama",
        "llama",
        seed=seed,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    sets = (("q_proj", "v_proj"), ("o_proj", "gate_proj", "up_proj", "down_proj"), None)
    requests = [None]
    for i, (rank, modules) in enumerate(zip((4, 8, 16), sets, strict=True)):
        path = workdir / f"lora_adapter{i}"
        write_random_adapter(
            model_dir, path, rank, seed + i, **({"modules": modules} if modules else {}), std=0.1
        )
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in prompt_lengths]
    loras = [requests[i % len(requests)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    for backend in (kernel_backend, "torch"):
        with LLM(
            str(model_dir),
            device=device,
            dtype="float32",
            kernel_backend=backend,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
            max_num_batched_tokens=48,
        ) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            tokens[backend] = [o.outputs[0].token_ids for o in outs]
        # An engine on CUDA takes gpu_memory_utilization of the memory left for its KV cache: the
        # next one finds none while this one (held by `llm` and its reference cycles) lives.
        del llm, outs
        release_gpu_memory()
    result["equal_to_torch_twin"] = tokens[kernel_backend] == tokens["torch"]
    result["throughput"] = _lora_throughput(
        device, workdir, seed, kernel_backend, perf_cfg, perf_requests, perf_lengths
    )
    return result


def _lora_throughput(device, workdir, seed, kernel_backend, cfg, num_requests, lengths) -> dict:
    from benchmarks.random_adapter import write_random_adapter
    from engine_svc import LLM, LoRARequest, SamplingParams

    model_dir = write_config_only_model(workdir / "lora_perf_model", cfg)
    names = [LoRARequest(f"perf{i}", 100 + i, str(workdir / f"lora_perf{i}")) for i in range(4)]
    for i, r in enumerate(names):
        write_random_adapter(model_dir, r.lora_path, 16, seed + 10 + i)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(lengths[0])] for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=lengths[1], ignore_eos=True)
    loras = [names[i % 4] for i in range(num_requests)]
    with LLM(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        device=device,
        kernel_backend=kernel_backend,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        enable_prefix_caching=False,
    ) as llm:

        def timed(p, lo) -> float:
            t0 = time.perf_counter()
            outs = llm.generate(p, params, use_tqdm=False, lora_request=lo)
            return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

        timed(prompts[:8], loras[:8])  # compile and load first
        base = timed(prompts, None)
        mixed = timed(prompts, loras)
        separate_tokens, separate_s = 0, 0.0
        for r in names:
            mine = [p for p, lo in zip(prompts, loras, strict=True) if lo is r]
            t0 = time.perf_counter()
            outs = llm.generate(mine, params, use_tqdm=False, lora_request=r)
            separate_s += time.perf_counter() - t0
            separate_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    separate = separate_tokens / separate_s
    return dict(
        base_tok_s=base,
        adapters_tok_s=mixed,
        separate_tok_s=separate,
        adapters_vs_base=mixed / base,
        mixed_vs_separate=mixed / separate,
    )


def _batch1_decode(engine, cfg: dict, steps: int, seed: int, peak: float | None) -> dict:
    """Median wall time of one decode step of a lone request (each step returns its token to the
    host, so a step's time is its whole cost)."""
    import statistics

    from engine_svc import SamplingParams

    prompt = mixed_requests(1, seed + 2, cfg["vocab_size"], (128, 128))[0][0]
    engine.add_request(
        "batch1", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    )
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    decode = times[1:]  # the first step is the prefill
    per_token = statistics.median(decode)
    out = dict(
        prompt_len=len(prompt), decode_steps=len(decode), s_per_token=per_token, tokens_per_s=1.0 / per_token
    )
    if peak:
        floor = decode_floor_seconds(cfg, 2, peak)
        out.update(floor, ratio_to_floor=per_token / floor["floor_s"])
    return out


# --- driver ----------------------------------------------------------------------------------


def device_facts(peak_override: float | None) -> dict:
    import torch

    facts = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda_available=torch.cuda.is_available(),
    )
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    peak, source = peak_bandwidth(facts.get("device", ""), peak_override)
    facts.update(peak_bandwidth_gb_per_s=peak / 1e9 if peak else None, peak_bandwidth_source=source)
    return facts


def run(args: argparse.Namespace) -> dict:
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "gpu_check.json"
    facts = device_facts(args.peak_bandwidth_tbps)
    report = dict(facts=facts, sections={})
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device: this check needs an NVIDIA GPU"
        report_path.write_text(json.dumps(report, indent=2))
        return report
    peak = facts["peak_bandwidth_gb_per_s"] * 1e9 if facts["peak_bandwidth_gb_per_s"] else None
    device = "cuda"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        jobs = {
            "kernels": lambda: section_kernels(device),
            "attention_vs_sdpa": lambda: section_attention_vs_sdpa(device),
            "decode_bandwidth": lambda: section_decode_bandwidth(device, peak),
            "tiny_hf_equality": lambda: section_tiny_hf_equality(device, work, args.seed),
            "lora": lambda: section_lora(device, work, args.seed),
            "llama3_8b": lambda: section_llama3_8b(
                device, work, peak, args.requests, args.decode_steps, args.seed
            ),
        }
        for name in SECTIONS:
            if name not in args.sections:
                continue
            if time.perf_counter() - started > args.time_budget_s:
                report["sections"][name] = dict(status="skipped", reason="time budget spent")
                continue
            t0 = time.perf_counter()
            try:
                body = jobs[name]()
                report["sections"][name] = dict(
                    status="ok", seconds=round(time.perf_counter() - t0, 2), **body
                )
            except Exception as exc:  # one section failing must not lose the others' figures
                report["sections"][name] = dict(
                    status="error",
                    seconds=round(time.perf_counter() - t0, 2),
                    error=repr(exc),
                    traceback=traceback.format_exc(),
                )
            finally:
                release_gpu_memory()
            report_path.write_text(json.dumps(report, indent=2))
            print(
                f"[gpu_check] {name}: {report['sections'][name]['status']} "
                f"({report['sections'][name].get('seconds', 0)} s)",
                flush=True,
            )
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    report_path.write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(summary(report), indent=2))
    failed = report.get("error") or any(s.get("status") == "error" for s in report["sections"].values())
    return 1 if failed else 0


def summary(report: dict) -> dict:
    """The headline figures, for the console and the README."""
    s = report.get("sections", {})
    out: dict = dict(device=report["facts"].get("device"), date=report["facts"]["date"])
    if "error" in report:
        out["error"] = report["error"]
    if s.get("kernels", {}).get("status") == "ok":
        out["kernels"] = f"{s['kernels']['passed']} passed, {s['kernels']['failed']} failed"
    if s.get("attention_vs_sdpa", {}).get("status") == "ok":
        out["paged_over_sdpa"] = {
            f"b{r['batch']}-L{r['seq_len']}-q{r['q_len']}-d{r['head_dim']}": round(
                r["ratio_paged_over_sdpa"], 3
            )
            for r in s["attention_vs_sdpa"]["runs"]
        }
    if s.get("decode_bandwidth", {}).get("status") == "ok":
        out["decode_fraction_of_peak"] = {
            f"b{r['batch']}-L{r['seq_len']}": r["fraction_of_peak"] for r in s["decode_bandwidth"]["runs"]
        }
    if s.get("tiny_hf_equality", {}).get("status") == "ok":
        out["tiny_hf_equal"] = s["tiny_hf_equality"]["all_equal"]
    if s.get("lora", {}).get("status") == "ok":
        lo = s["lora"]
        out["lora"] = dict(
            kernels_ok=lo["kernels_ok"],
            equal_to_torch_twin=lo["equal_to_torch_twin"],
            adapters_vs_base=round(lo["throughput"]["adapters_vs_base"], 3),
            mixed_vs_separate=round(lo["throughput"]["mixed_vs_separate"], 3),
        )
    if s.get("llama3_8b", {}).get("status") == "ok":
        b1, tp = s["llama3_8b"]["batch1_decode"], s["llama3_8b"]["throughput"]
        out["llama3_8b_batch1_ms_per_token"] = round(b1["s_per_token"] * 1e3, 3)
        out["llama3_8b_batch1_ratio_to_floor"] = b1.get("ratio_to_floor")
        out["llama3_8b_output_tokens_per_s"] = round(tp["output_tokens_per_s"], 1)
    out["status"] = {k: v.get("status") for k, v in s.items()}
    return out


if __name__ == "__main__":
    sys.exit(main())
