"""The CPU paths of ``kernels/cpu``: attention against the reference twin, the prepacked oneDNN
linear against ``F.linear``, the run-time choice between them and their fallbacks, and greedy
equality with HF on every path this machine can run (the forced fallbacks included)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
from kernels.backend import REFERENCE_KERNELS, TORCH_KERNELS, select_kernels
from kernels.cpu import linear as cpu_linear
from kernels.cpu import native_attention, native_gemm
from kernels.cpu import paged_attention as cpu_attention
from kernels.cpu.features import cpu_features, native_bf16
from kernels.reference.paged_attention import paged_attention as reference_attention
from tests.engine_helpers import (
    assert_greedy_matches,
    hf_greedy,
    make_engine,
    random_prompts,
    run_to_completion,
)
from tests.kernel_cases import MIXED_CASES, SPLIT_DECODE_CASES, AttentionCase, make_paged_batch

# Many decodes of scattered lengths (several length groups, chunks of a few rows) beside prefills.
DECODE_HEAVY = AttentionCase(
    tuple((n, 1) for n in (3, 17, 64, 65, 200, 201, 203, 250, 511, 512, 47, 48, 49)) + ((90, 30), (33, 33)),
    8,
    2,
    64,
    16,
)
CPU_CASES = MIXED_CASES + SPLIT_DECODE_CASES + (DECODE_HEAVY,)


def test_torch_backend_uses_the_cpu_attention_and_reference_stays_selectable():
    assert select_kernels("cpu") is TORCH_KERNELS
    # The native kernel's wrapper, which hands what it does not take to this torch path.
    assert TORCH_KERNELS.paged_attention is native_attention.paged_attention
    assert select_kernels("cpu", "reference") is REFERENCE_KERNELS
    assert REFERENCE_KERNELS.paged_attention is reference_attention


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.label)
def test_cpu_paged_attention_equals_reference_fp32(case):
    batch = make_paged_batch(case, torch.float32, seed=11)
    got = cpu_attention.paged_attention(*batch.args(), **batch.bounds())
    torch.testing.assert_close(got, reference_attention(*batch.args()), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native_bf16(), reason="no AVX-512 BF16 / AMX on this CPU")
def test_cpu_paged_attention_bf16_close_to_fp32_reference():
    batch = make_paged_batch(DECODE_HEAVY, torch.bfloat16, seed=5)
    got = cpu_attention.paged_attention(*batch.args()).float()
    f32 = make_paged_batch(DECODE_HEAVY, torch.float32, seed=5)  # the same draws, before rounding
    f32.q, f32.k_cache, f32.v_cache = batch.q.float(), batch.k_cache.float(), batch.v_cache.float()
    torch.testing.assert_close(got, reference_attention(*f32.args()), rtol=3e-2, atol=3e-2)


def test_decode_chunking_changes_results_by_rounding_only(monkeypatch):
    batch = make_paged_batch(DECODE_HEAVY, torch.float32, seed=2)
    whole = cpu_attention.paged_attention(*batch.args())
    monkeypatch.setattr(cpu_attention, "DECODE_CHUNK_BYTES", 1)  # one request per SDPA call
    # SDPA's CPU kernel rounds a row differently with the batch around it (~1e-7 here).
    torch.testing.assert_close(cpu_attention.paged_attention(*batch.args()), whole, rtol=1e-6, atol=1e-6)


def test_cpu_paged_attention_ignores_blocks_outside_the_table():
    case = MIXED_CASES[1]
    batch = make_paged_batch(case, torch.float32, seed=3)
    before = cpu_attention.paged_attention(*batch.args())
    used = set()
    for b, (ctx, _) in enumerate(case.requests):
        used |= set(batch.block_tables[b, : (ctx + case.block_size - 1) // case.block_size].tolist())
    unused = [i for i in range(batch.k_cache.shape[0]) if i not in used]
    assert unused
    batch.k_cache[unused] = float("nan")
    batch.v_cache[unused] = float("nan")
    for b, (ctx, _) in enumerate(case.requests):
        last = int(batch.block_tables[b, (ctx - 1) // case.block_size])
        batch.k_cache[last, ctx % case.block_size or case.block_size :] = float("nan")
        batch.v_cache[last, ctx % case.block_size or case.block_size :] = float("nan")
    torch.testing.assert_close(cpu_attention.paged_attention(*batch.args()), before)


# --- linear layers ---------------------------------------------------------------------------

onednn_here = pytest.mark.skipif(
    cpu_linear.onednn_unusable_reason(torch.device("cpu"), torch.float32) is not None,
    reason="no oneDNN linear in this torch build",
)


@onednn_here
@pytest.mark.parametrize("m", [1, 7, 64, 512])
@pytest.mark.parametrize("k,n,bias", [(512, 1408, False), (1408, 512, False), (64, 200, True)])
def test_onednn_linear_equals_f_linear_fp32(m, k, n, bias):
    g = torch.Generator().manual_seed(m + k)
    w = torch.randn(n, k, generator=g) * k**-0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    got = cpu_linear.OneDNNLinear(w, b)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@onednn_here
def test_onednn_linear_takes_an_empty_batch_and_strided_rows():
    w = torch.randn(96, 32)
    lin = cpu_linear.OneDNNLinear(w)
    assert lin(torch.randn(0, 32)).shape == (0, 96)
    x = torch.randn(10, 64)[:, :32]  # a column slice: non-contiguous rows
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native_bf16(), reason="no AVX-512 BF16 / AMX on this CPU")
def test_onednn_linear_bf16_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1408, 512, generator=g) * 512**-0.5
    x = torch.randn(33, 512, generator=g)
    got = cpu_linear.OneDNNLinear(w.bfloat16())(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w), rtol=3e-2, atol=3e-2)


def test_linear_backend_choice_and_fallbacks(monkeypatch, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cpu_linear.resolve_linear_backend("dense", cpu, torch.float32) == "dense"
    assert cpu_linear.resolve_linear_backend(None, cuda, torch.bfloat16) == "dense"
    with pytest.raises(ValueError, match="linear_backend"):
        cpu_linear.resolve_linear_backend("mkl", cpu, torch.float32)
    assert cpu_linear.resolve_linear_backend("auto", cpu, torch.float32) == auto_fp32_backend()
    # A GEMM that computes wrong numbers (or none) is never served: auto falls back, with a log line.
    monkeypatch.setattr(cpu_linear, "_probe_ok", lambda dtype, kind=None: False)
    with caplog.at_level(logging.INFO, logger="kernels.cpu.linear"):
        assert cpu_linear.resolve_linear_backend("auto", cpu, torch.float32) == "dense"
    assert "F.linear" in caplog.text
    with pytest.raises(ValueError, match="unavailable"):
        cpu_linear.resolve_linear_backend("onednn", cpu, torch.float32)


def test_bf16_without_native_instructions_skips_onednn(monkeypatch):
    """oneDNN's bf16 needs AVX-512 BF16 / AMX; the native GEMM's bf16 weights (widened to fp32) do not."""
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    assert "BF16" in cpu_linear.onednn_unusable_reason(torch.device("cpu"), torch.bfloat16)
    native = native_gemm.unusable_reason(torch.bfloat16) is None
    want = cpu_linear.NATIVE_BF16 if native else "dense"
    assert cpu_linear.resolve_linear_backend("auto", torch.device("cpu"), torch.bfloat16) == want


def test_probe_passes_where_onednn_runs():
    if cpu_features()["onednn"]:
        assert cpu_linear._probe_ok(torch.float32)
    if native_bf16():
        assert cpu_linear._probe_ok(torch.bfloat16)


# --- the engine on each path -----------------------------------------------------------------


def auto_fp32_backend() -> str:
    if native_gemm.unusable_reason(torch.float32) is None:
        return "native"
    return "onednn" if cpu_features()["onednn"] else "dense"


PATHS = [
    pytest.param("auto", None, id="default"),  # native GEMM + CPU attention where this machine has them
    pytest.param("onednn", None, id="onednn", marks=onednn_here),
    pytest.param("dense", None, id="f_linear"),
    pytest.param("dense", "reference", id="reference_twins"),
]


@pytest.fixture(scope="module")
def llama_case(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()
    prompts = random_prompts([1, 9, 16, 41, 77], 1024, seed=21)
    prompts.append(prompts[3][:32] + [5, 6, 7])  # a prefix-cache hit
    return tiny_llama, hf, prompts, [hf_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("linear_backend,kernel_backend", PATHS)
def test_greedy_equals_hf_on_each_cpu_path(llama_case, linear_backend, kernel_backend):
    model_dir, hf, prompts, refs = llama_case
    engine = make_engine(
        model_dir,
        block_size=16,
        max_num_batched_tokens=48,
        linear_backend=linear_backend,
        kernel_backend=kernel_backend,
    )
    want = auto_fp32_backend() if linear_backend == "auto" else linear_backend
    assert engine.model.linear_backend == want
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf, p, outputs[(str(i), 0)], ref)


def test_decodes_equal_the_reference_within_rounding():
    """The CPU path groups a KV head's query heads as query positions (the reference repeats K/V):
    the same sums in another order, so an ulp or so apart."""
    case = AttentionCase(tuple((n, 1) for n in (3, 17, 64, 65, 200, 201, 203, 511, 512)), 8, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=4)
    got = cpu_attention.paged_attention(*batch.args())
    torch.testing.assert_close(got, reference_attention(*batch.args()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("linear_backend", ["auto", "dense"])
def test_bf16_engine_on_cpu_says_what_it_runs_on(tiny_llama, caplog, linear_backend):
    with caplog.at_level(logging.INFO, logger="engine_svc.model_setup"):
        engine = make_engine(tiny_llama, dtype="bfloat16", device="cpu", linear_backend=linear_backend)
    if linear_backend == "auto" and engine.model.linear_backend == cpu_linear.NATIVE_BF16:
        assert "bf16 weights, fp32 activations on the native GEMM" in caplog.text
    else:
        line = "native bf16 matmuls" if native_bf16() else "emulated, slower than float32"
        assert line in caplog.text
        packed = linear_backend == "auto" and native_bf16()
        assert engine.model.linear_backend == ("onednn" if packed else "dense")
    prompts = random_prompts([5, 40], 1024, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert all(len(outputs[(str(i), 0)]) == 6 for i in range(len(prompts)))


def shared_prefix_batch(num_rows=6, prefix_blocks=9, bs=16, hq=8, hk=2, d=64, seed=7):
    """Decode rows whose tables begin with the same blocks (a cached system prompt), each with its
    own tail of scattered blocks and its own length, plus one row that shares nothing."""
    g = torch.Generator().manual_seed(seed)
    total = 200
    k_cache = torch.randn(total, bs, hk, d, generator=g)
    v_cache = torch.randn(total, bs, hk, d, generator=g)
    perm = torch.randperm(total, generator=g).tolist()
    prefix, rest = perm[:prefix_blocks], perm[prefix_blocks:]
    lens, tables = [], []
    for i in range(num_rows + 1):
        length = prefix_blocks * bs + 1 + 13 * i  # the last row has a tail of 6 blocks
        own = -(-(length - prefix_blocks * bs) // bs)
        if i < num_rows:
            tables.append(prefix + rest[:own])
        else:  # a row with the same length but its own blocks
            tables.append(rest[: prefix_blocks + own])
        rest = rest[prefix_blocks + own :]
        lens.append(length)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    return (q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), qsl, d**-0.5)


def test_cascade_attention_over_a_shared_prefix_equals_the_reference(monkeypatch):
    args = shared_prefix_batch()
    seen = []
    groups = cpu_attention.shared_prefix_groups
    monkeypatch.setattr(cpu_attention, "shared_prefix_groups", lambda *a: seen.append(groups(*a)) or seen[-1])
    got = cpu_attention.paged_attention(*args)
    assert seen == [[([0, 1, 2, 3, 4, 5], 9)]], "the six rows sharing nine blocks should go through cascade"
    torch.testing.assert_close(got, reference_attention(*args), rtol=1e-5, atol=1e-6)
    # Too few sharers, or too short a shared prefix: the plain path, same results.
    monkeypatch.setattr(cpu_attention, "CASCADE_MIN_ROWS", 7)
    seen.clear()
    torch.testing.assert_close(cpu_attention.paged_attention(*args), got, rtol=1e-5, atol=1e-6)
    assert all(groups == [] for groups in seen)


def test_shared_prefix_groups_stop_where_the_tables_part():
    tables = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 1, 2], [5, 6, 7, 3], [4, 6, 7, 8]])
    lens = [64, 64, 64, 64, 64]
    monkey_min = cpu_attention.CASCADE_MIN_TOKENS
    try:
        cpu_attention.CASCADE_MIN_TOKENS = 16
        assert cpu_attention.shared_prefix_groups(tables, [0, 1, 2, 3, 4], lens, 16) == [([0, 1, 2, 3], 2)]
        # Never the block holding a row's last token: lens of 33 leave two full blocks at most.
        assert cpu_attention.shared_prefix_groups(tables, [0, 1, 3, 4], [33] * 5, 16) == []
        assert cpu_attention.shared_prefix_groups(tables, [0, 1, 3], [49] * 5, 16) == []  # 3 rows
    finally:
        cpu_attention.CASCADE_MIN_TOKENS = monkey_min


def test_greedy_equals_hf_with_decodes_over_a_shared_prefix(tiny_llama, monkeypatch):
    """Five requests behind one 144-token system prompt: on the torch path (the native kernel off:
    it is faster than cascade where it runs) their decodes take cascade attention (the prefix cache
    gives them the same blocks) and the tokens stay HF's."""
    monkeypatch.setenv("LLMSERVE_NATIVE_ATTENTION", "0")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()
    (prefix,) = random_prompts([144], 1024, seed=31)
    prompts = [prefix + own for own in random_prompts([3, 7, 11, 5, 9], 1024, seed=32)]
    cascades = []
    groups = cpu_attention.shared_prefix_groups
    monkeypatch.setattr(
        cpu_attention, "shared_prefix_groups", lambda *a: cascades.extend(groups(*a)) or groups(*a)
    )
    engine = make_engine(tiny_llama, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert any(len(rows) == 5 for rows, _ in cascades), "the decodes never went through cascade attention"
    for i, p in enumerate(prompts):
        assert_greedy_matches(hf, p, outputs[(str(i), 0)], hf_greedy(hf, p, 12))


GEMM_SHAPES_SCRIPT = """
import sys, torch
from kernels.cpu.linear import OneDNNLinear
torch.set_num_threads(1)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
lins = [OneDNNLinear(torch.randn(n, 256)) for n in (384, 1024, 4096)]
for m in range(1, 9):  # the first shapes: buffers every later call reuses
    [lin(torch.randn(m, 256)) for lin in lins]
start = rss()
for m in range(9, 240):
    [lin(torch.randn(m, 256)) for lin in lins]
print((rss() - start) >> 20)
"""


@pytest.mark.skipif(not cpu_features()["onednn"], reason="this torch build has no oneDNN linear ops")
@pytest.mark.parametrize("entries, bound", [(None, 24), ("1024", None)])
def test_packed_gemms_over_many_row_counts_hold_bounded_memory(entries, bound):
    """A step's row count changes all the time; oneDNN's and ideep's shape-keyed caches, left at
    1024 entries, grow the process by ~0.2 MiB per new shape. The module caps them (run with its
    default) and the resident set stays flat; the uncapped run shows the test can tell."""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    }
    env["MALLOC_MMAP_THRESHOLD_"] = str(256 << 10)  # as the engine process sets it
    if entries is not None:
        env["LRU_CACHE_CAPACITY"] = env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = entries
    out = subprocess.run(
        [sys.executable, "-c", GEMM_SHAPES_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grew_mib = int(out.stdout.split()[-1])
    if bound is not None:
        assert grew_mib < bound, f"grew {grew_mib} MiB over 231 row counts"  # 3 MiB measured
    else:
        assert grew_mib > 2 * 24, f"uncapped caches grew only {grew_mib} MiB: the test cannot tell"  # 376
