"""The native CPU kernels against the torch paths they replace, call by call, at the 55M model's
shapes (8 query heads, 2 KV heads, head size 64, hidden 512), in one run and alternating:

    python -m benchmarks.cpu_kernels [--quick] [--threads N]

- paged attention: ``kernels/cpu/native_attention.py`` (reads the blocks in place) against
  ``kernels/cpu/paged_attention.py`` (torch's SDPA over blocks gathered with ``index_select``,
  cascade over shared prefixes), for decodes, fresh prompts, chunks after a cached prefix, and
  decodes sharing a prefix; on this CPU's instruction set and, labelled, on each other one it runs;
- RMSNorm with its residual add, rotary embedding and SiLU-and-multiply (the 55M model's 1,408-wide
  MLP): ``kernels/cpu/native_elementwise.py`` against the reference twins, at 1, 64 and 2048 tokens;
- the linears (``kernels/cpu/native_gemm.py``) against oneDNN's prepacked linear, on the model's
  five weight shapes at 1 to 512 rows, each side cycling over enough copies of the weight (96 MB,
  three times this machine's L3) that it comes from memory, as in a step that streams every layer.

Each figure is the median of ``reps`` calls after a warm-up, and the two sides alternate ``rounds``
times (the lower median of the rounds is kept, so that a burst of other load on a shared machine
does not pick the winner). Targets: native attention no slower than the torch path (>= 1.0x) on
every shape, and the native GEMM no slower than oneDNN at decode sizes (M <= 64), on the chosen
instruction set.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import common
from kernels.cpu import linear as cpu_linear
from kernels.cpu import native_attention, native_build, native_elementwise, native_gemm
from kernels.cpu import paged_attention as torch_attention
from kernels.reference import activation, rmsnorm, rotary
from tests.kernel_cases import AttentionCase, make_paged_batch

HQ, HK, D = 8, 2, 64
FULL = dict(
    reps=9,
    rounds=3,
    attention={
        "decode 64 x 512": [(512, 1)] * 64,
        "decode 64 x 32..1024": [(32 + (i * 331) % 993, 1) for i in range(64)],
        "decode 16 x 2048": [(2048, 1)] * 16,
        "prompt 1 x 512": [(512, 512)],
        "chunks 4 x 64 after 1088 cached": [(1152, 64)] * 4,
        "chunks 8 x 16 after 584 cached": [(600, 16)] * 8,
    },
    shared_prefix=dict(rows=64, prefix_blocks=64, own=64),
    elementwise_tokens=(1, 64, 2048),
    gemm_shapes={
        "qkv": (768, 512),
        "o": (512, 512),
        "gate_up": (2816, 512),
        "down": (512, 1408),
        "lm_head": (32000, 512),
    },
    gemm_rows=(1, 16, 64, 512),
    gemm_cold_bytes=96 << 20,
)
QUICK = dict(
    reps=2,
    rounds=1,
    attention={
        "decode 4 x 40": [(40, 1)] * 4,
        "prompt 1 x 24": [(24, 24)],
        "chunk 1 x 8 after 20": [(28, 8)],
    },
    shared_prefix=dict(rows=4, prefix_blocks=8, own=16),
    elementwise_tokens=(1, 16),
    gemm_shapes={"qkv": (768, 512), "down": (512, 1408)},
    gemm_rows=(1, 8),
    gemm_cold_bytes=0,
)


def median_time(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ab(fast, slow, reps: int, rounds: int) -> dict:
    """Alternating medians of two callables: seconds each and the ratio slow / fast."""
    a, b = [], []
    for _ in range(rounds):
        b.append(median_time(slow, reps))
        a.append(median_time(fast, reps))
    return dict(native_ms=min(a) * 1e3, torch_ms=min(b) * 1e3, speedup=min(b) / min(a))


def shared_prefix_batch(rows: int, prefix_blocks: int, own: int, bs: int = 16) -> tuple:
    """Decode rows whose tables begin with the same blocks (a cached 1024-token prefix), each with its
    own tail: what cascade attention takes on the torch path."""
    g = torch.Generator().manual_seed(0)
    own_blocks = -(-own // bs) + 1
    total = prefix_blocks + rows * own_blocks + 1
    k_cache, v_cache = (torch.randn(total, bs, HK, D, generator=g) for _ in range(2))
    perm = torch.randperm(total, generator=g).tolist()
    prefix, rest = perm[:prefix_blocks], perm[prefix_blocks:]
    tables = [prefix + rest[i * own_blocks : (i + 1) * own_blocks] for i in range(rows)]
    lens = [prefix_blocks * bs + own - i % 7 for i in range(rows)]
    q = torch.randn(rows, HQ, D, generator=g)
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    return (
        q,
        k_cache,
        v_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        qsl,
        D**-0.5,
    )


def attention_rows(w: dict) -> list[dict]:
    rows = []
    shapes = {
        name: make_paged_batch(AttentionCase(tuple(reqs), HQ, HK, D, 32), torch.float32, seed=1).args()
        for name, reqs in w["attention"].items()
    }
    sp = w["shared_prefix"]
    shapes[f"decode {sp['rows']} sharing a {sp['prefix_blocks'] * 16}-token prefix"] = shared_prefix_batch(
        **sp
    )
    for isa in native_build.supported_isas():
        if native_attention.library(isa) is None:
            continue
        for name, args in shapes.items():
            r = ab(
                lambda a=args, i=isa: native_attention.paged_attention(*a, isa=i),
                lambda a=args: torch_attention.paged_attention(*a),
                w["reps"],
                w["rounds"],
            )
            rows.append(dict(shape=name, isa=isa, **r))
            ms = f"native {r['native_ms']:7.2f} ms, torch {r['torch_ms']:7.2f} ms"
            print(f"  attention {isa:>7} {name:>40}: {ms}, {r['speedup']:.2f}x")
    return rows


def elementwise_pairs(t: int, g: torch.Generator, isa: str) -> dict:
    """Per kernel: (native, reference) callables on ``t`` tokens' worth of inputs."""
    cos_sin = rotary.rope_cos_sin_cache(rotary.rope_inv_freq(D, 10000.0), 4096)
    x, res, weight = (
        torch.randn(t, 512, generator=g),
        torch.randn(t, 512, generator=g),
        torch.randn(512, generator=g),
    )
    qkv = torch.randn(t, (HQ + 2 * HK) * D, generator=g)
    q, k = qkv[:, : HQ * D].view(t, HQ, D), qkv[:, HQ * D : (HQ + HK) * D].view(t, HK, D)
    pos = torch.randint(0, 4096, (t,), generator=g)
    gate_up = torch.randn(t, 2 * 1408, generator=g)
    return {
        "rms_norm + residual": (
            lambda: native_elementwise.rms_norm(x, weight, 1e-6, res, isa=isa),
            lambda: rmsnorm.rms_norm(x, weight, 1e-6, res),
        ),
        "rotary": (
            lambda: native_elementwise.apply_rotary(pos, q, k, cos_sin, isa=isa),
            lambda: rotary.apply_rotary(pos, q, k, cos_sin),
        ),
        "silu_and_mul": (
            lambda: native_elementwise.silu_and_mul(gate_up, isa=isa),
            lambda: activation.silu_and_mul(gate_up),
        ),
    }


def elementwise_rows(w: dict) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    isa = native_build.chosen_isa()  # silu_and_mul measured here even where it is not the default
    for t in w["elementwise_tokens"]:
        for name, (fast, slow) in elementwise_pairs(t, g, isa).items():
            r = ab(fast, slow, w["reps"] * 3, w["rounds"])
            rows.append(dict(kernel=name, tokens=t, isa=isa, **r))
            print(
                f"  {name:>20} {t:5d} tokens: native {r['native_ms']:.3f} ms, torch {r['torch_ms']:.3f} ms",
                end="",
            )
            print(f", {r['speedup']:.2f}x")
    return rows


def gemm_rows(w: dict) -> list[dict]:
    """Native GEMM against oneDNN's prepacked linear (empty where this torch has no oneDNN)."""
    if cpu_linear.onednn_unusable_reason(torch.device("cpu"), torch.float32) is not None:
        print("  GEMM: no oneDNN linear in this torch build, nothing to compare")
        return []
    rows, isa = [], native_build.chosen_isa()
    g = torch.Generator().manual_seed(1)
    for name, (n, k) in w["gemm_shapes"].items():
        copies = max(1, -(-w["gemm_cold_bytes"] // (n * k * 4)))
        weights = [torch.randn(n, k, generator=g) * k**-0.5 for _ in range(copies)]
        native = [native_gemm.NativeLinear(x, isa=isa) for x in weights]
        onednn = [cpu_linear.OneDNNLinear(x) for x in weights]
        for m in w["gemm_rows"]:
            x = torch.randn(m, k, generator=g)

            def cycle(lins, x=x):
                return lambda: [lin(x) for lin in lins]

            r = ab(cycle(native), cycle(onednn), max(3, w["reps"] // 3), w["rounds"])
            native_ms, onednn_ms = r["native_ms"] / copies, r["torch_ms"] / copies
            rows.append(
                dict(
                    weight=name,
                    m=m,
                    n=n,
                    k=k,
                    isa=isa,
                    copies=copies,
                    native_ms=native_ms,
                    onednn_ms=onednn_ms,
                )
            )
            rows[-1]["speedup"] = onednn_ms / native_ms
            gflop = 2 * m * n * k / 1e6
            print(
                f"  GEMM {name:>8} M={m:<4} N={n:<5} K={k:<4}: native {gflop / native_ms:.0f} GFLOP/s, "
                f"oneDNN {gflop / onednn_ms:.0f} GFLOP/s, {onednn_ms / native_ms:.2f}x"
            )
    return rows


def main() -> dict:
    args, t_start, w, _ = common.begin(__doc__.split("\n\n")[0], FULL, QUICK)
    if native_attention.library() is None or native_elementwise.library() is None:
        raise SystemExit("the native kernels did not build on this machine: nothing to compare")
    chosen = native_build.chosen_isa()
    attention = attention_rows(w)
    elementwise = elementwise_rows(w)
    gemm = gemm_rows(w)
    mine = [r for r in attention if r["isa"] == chosen]
    targets = [
        common.target(
            f"native paged attention vs the torch path, slowest of {len(mine)} shapes ({chosen})",
            min(r["speedup"] for r in mine),
            ">=",
            1.0,
            "x",
        )
    ]
    decode_gemms = [r for r in gemm if r["m"] <= 64]
    if decode_gemms and chosen in native_gemm.FASTER_THAN_ONEDNN:
        targets.append(
            common.target(
                f"native GEMM vs oneDNN at M <= 64, slowest of {len(decode_gemms)} ({chosen})",
                min(r["speedup"] for r in decode_gemms),
                ">=",
                1.0,
                "x",
            )
        )
    figures = dict(
        attention=attention,
        elementwise=elementwise,
        gemm=gemm,
        chosen_isa=chosen,
        isas=native_build.supported_isas(),
    )
    return common.finish(
        "cpu_kernels", args, dict(workload=w, heads=(HQ, HK, D)), figures, targets, None, t_start
    )


if __name__ == "__main__":
    main()
