"""The native CPU kernels (``kernels/cpu/native/``: paged attention, RMSNorm, rotary), on every instruction
set this CPU runs (AVX-512, AVX2, generic; each built here and tested where the test runs):
against the reference twin (an independent reader: advanced indexing + SDPA), a row's output
bit-equal whatever shares its call (alone, in a batch, in any split of its chunk), the
cache outside a row's table never read, and the routing and fallbacks of the wrapper."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.backend import TORCH_KERNELS, select_kernels
from kernels.cpu import native_attention, native_build, native_elementwise
from kernels.cpu import paged_attention as torch_path
from kernels.reference import activation, rmsnorm, rotary
from kernels.reference.paged_attention import paged_attention as reference_attention
from tests.kernel_cases import MIXED_CASES, SPLIT_DECODE_CASES, WINDOW_CASES, AttentionCase, make_paged_batch

ISAS = native_build.supported_isas()

SHAPES = [
    # (requests (seq_len, q_len), Hq, Hk, D, block size): GQA 1..32 query heads per KV head, head
    # sizes 16..128, block sizes 1..64, contexts that end mid-block, chunks after a cached prefix.
    AttentionCase(((1, 1), (2, 1), (33, 1), (700, 1), (129, 5), (64, 64)), 4, 4, 64, 16),
    AttentionCase(((31, 1), (300, 300), (1000, 37), (17, 1)), 16, 1, 64, 32),
    AttentionCase(((5, 5), (90, 1), (257, 256)), 8, 2, 128, 8),
    AttentionCase(((40, 1), (41, 2), (70, 70)), 6, 3, 16, 1),
    AttentionCase(((130, 1), (200, 9), (64, 1)), 8, 4, 32, 64),
    AttentionCase(((77, 1), (150, 13), (40, 40)), 32, 1, 48, 16),
]
CASES = MIXED_CASES + SPLIT_DECODE_CASES + tuple(SHAPES)


# The attention paths: every instruction set's build, and the AVX-512 build with its AMX-BF16 tile
# path switched on ("avx512+amx": q . k and the pass over V on exact bf16 splits; where the OS grants
# the tiles, else skipped with the reason).
ATTENTION_PATHS = [*ISAS, *(["avx512+amx"] if "avx512" in ISAS else [])]


@pytest.fixture(params=ATTENTION_PATHS)
def isa(request):
    isa, _, tiles = request.param.partition("+")
    if native_attention.library(isa) is None:
        pytest.fail(f"the native kernel did not build for {isa} (a C compiler is on this machine)")
    if not tiles:
        yield isa
        return
    fp32 = (torch.float32,)  # the fp32 cache's build (a bf16 cache's keeps its own default)
    if not native_attention.amx_tiles(True, isa, fp32):
        native_attention.amx_tiles(False, isa, fp32)
        pytest.skip("this machine does not grant AMX-BF16 tiles (amx.h's probe)")
    try:
        yield isa
    finally:
        native_attention.amx_tiles(False, isa, fp32)


@pytest.mark.parametrize("exp_isa", ISAS)
def test_the_softmax_exp_is_within_its_stated_error_on_every_float_it_samples(exp_isa):
    # every 61st float of [-87, 0] (about 17 million, the worst case the docs state among them: the
    # error is measured over every float there), against e^x in double: 1.48 x 2^-24 where the
    # polynomial runs on fused multiply-adds (AVX-512, AVX2), 1.89 x 2^-24 without (generic); a
    # polynomial of degree 5 measured 2.76 x 2^-24. The tail of an array runs the scalar form: its
    # values are the same bits as the vector lanes'.
    import numpy as np

    lo = int(np.float32(-87.0).view(np.uint32))
    bits = np.concatenate(
        [np.arange(0x80000000, lo + 1, 61, dtype=np.uint64), [np.float32(-27.377251).view(np.uint32)]]
    )
    x = bits.astype(np.uint32).view(np.float32)
    y = native_attention.softmax_exp(x, exp_isa)
    err = np.abs(y.astype(np.float64) / np.exp(x.astype(np.float64)) - 1).max() * 2.0**24
    assert err <= (1.48 if exp_isa != "generic" else 1.89) + 0.005, err
    tail = native_attention.softmax_exp(x[:37], exp_isa)  # 37: two or more vectors and a tail
    assert np.array_equal(tail, y[:37])
    one = np.array([native_attention.softmax_exp(x[i : i + 1], exp_isa)[0] for i in range(37)])
    assert np.array_equal(one, y[:37])
    below = native_attention.softmax_exp(np.array([-87.0, -90.0, -1e30, -np.inf], dtype=np.float32), exp_isa)
    assert np.all(below == below[0]) and 0 < below[0] < 1e-37  # clamped: e^-87 below -87
    assert native_attention.softmax_exp(np.zeros(1, dtype=np.float32), exp_isa)[0] == 1.0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_native_attention_equals_the_reference(isa, case):
    batch = make_paged_batch(case, torch.float32, seed=17)
    got = native_attention.paged_attention(*batch.args(), isa=isa)
    torch.testing.assert_close(got, reference_attention(*batch.args()), rtol=1e-5, atol=1e-5)


def _one_sequence(batch, b, rows=None, isa=None):
    """Sequence ``b`` of the batch alone, or only its chunk's ``rows`` (a ``range``), as a chunk ending
    at the last of them: the same queries seeing the same positions."""
    q, k_cache, v_cache, tables, lens, qsl, scale = batch.args()
    lo, hi = int(qsl[b]), int(qsl[b + 1])
    rows = rows or range(hi - lo)
    ctx = int(lens[b]) - (hi - lo) + rows.stop
    return native_attention.paged_attention(
        q[lo + rows.start : lo + rows.stop],
        k_cache,
        v_cache,
        tables[b : b + 1],
        torch.tensor([ctx], dtype=torch.int32),
        torch.tensor([0, len(rows)], dtype=torch.int32),
        scale,
        isa=isa,
    )


# (Hq, Hk): query heads per KV head that fill a tile (4), leave a decode group part-full (6, 1 on
# AVX-512's groups of four), straddle two tiles (12) and need several tiles per row (32).
@pytest.mark.parametrize("hq,hk", [(8, 2), (6, 1), (12, 1), (32, 1), (3, 3)])
def test_a_row_is_bit_equal_alone_in_a_batch_and_in_any_split_of_its_chunk(isa, hq, hk):
    """Each row is computed in the same order whatever shares its call, so its output is the same
    bits alone, beside others, however its chunk is split (which moves it to another lane of another
    tile), and as the decode of its own position (dot products, where a chunk's row is a lane: the
    tile sums in the decode's order). That last is what a recompute after preemption meets: tokens
    decoded one by one come back as rows of a chunk."""
    case = AttentionCase(((300, 1), (200, 37), (64, 64), (513, 1), (100, 9)), hq, hk, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=5)
    whole = native_attention.paged_attention(*batch.args(), isa=isa)
    starts = batch.args()[5].tolist()
    for b, (_, q_len) in enumerate(case.requests):
        lo, hi = starts[b], starts[b + 1]
        assert torch.equal(_one_sequence(batch, b, isa=isa), whole[lo:hi]), (
            f"sequence {b} changed with the batch"
        )
        if q_len < 4:
            continue
        for cut in (2, 3, q_len // 2, q_len - 2):  # parts of 2+ rows: a part of one row is a decode
            parts = [
                _one_sequence(batch, b, range(0, cut), isa),
                _one_sequence(batch, b, range(cut, q_len), isa),
            ]
            assert torch.equal(torch.cat(parts), whole[lo:hi]), f"sequence {b} split at {cut} changed"
        for i in range(q_len):  # query i of the chunk, as the decode of its own position
            decode = _one_sequence(batch, b, range(i, i + 1), isa)
            assert torch.equal(decode[0], whole[lo + i]), f"sequence {b} row {i} differs as a decode"


def _attend(batch, q, tables, lens, qsl, window, threads, isa):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _, k_cache, v_cache, *_, scale = batch.args()
        return native_attention.paged_attention(
            q, k_cache, v_cache, tables, lens, qsl, scale, window=window, isa=isa
        )
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("window", [None, 300])
def test_long_context_rows_are_bit_equal_over_partitions_threads_and_splits(isa, window):
    """Contexts over several of the kernel's KV partitions (256 positions, merged by an online
    softmax; a decode's partitions are separate work items, merged after them; a chunk's tiles go
    in groups of four): a row's bits are the same at one thread and two, alone and in the batch,
    in any split of its chunk (a chunk whose rows straddle a partition boundary: 1024), and as the
    decode of its own position; and within tolerance of the reference. The Qwen2.5-0.5B geometry:
    7 query heads per KV head, head size 64."""
    case = AttentionCase(((1300, 1), (1050, 60), (700, 1), (600, 9)), 14, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=11)
    q, _, _, tables, lens, qsl, _ = batch.args()
    one = _attend(batch, q, tables, lens, qsl, window, 1, isa)
    assert torch.equal(_attend(batch, q, tables, lens, qsl, window, 2, isa), one), "threads changed a row"
    torch.testing.assert_close(one, reference_attention(*batch.args(), window=window), rtol=1e-5, atol=1e-5)
    starts = qsl.tolist()

    def rows_of(b, rows, threads):  # sequence b's chunk rows alone, as a chunk ending at the last
        lo = starts[b]
        ctx = int(lens[b]) - (starts[b + 1] - lo) + rows.stop
        return _attend(
            batch,
            q[lo + rows.start : lo + rows.stop],
            tables[b : b + 1],
            torch.tensor([ctx], dtype=torch.int32),
            torch.tensor([0, len(rows)], dtype=torch.int32),
            window,
            threads,
            isa,
        )

    for b, (_, q_len) in enumerate(case.requests):
        lo = starts[b]
        assert torch.equal(rows_of(b, range(q_len), 2), one[lo : lo + q_len]), f"sequence {b} changed alone"
    lo = starts[1]
    for cut in (17, 33):
        parts = torch.cat([rows_of(1, range(0, cut), 1), rows_of(1, range(cut, 60), 2)])
        assert torch.equal(parts, one[lo : lo + 60]), f"the chunk split at {cut} changed"
    for i in (0, 32, 33, 34, 59):  # rows before, at and after position 1024
        assert torch.equal(rows_of(1, range(i, i + 1), 2)[0], one[lo + i]), f"row {i} differs as a decode"


def test_the_avx512_attention_builds_on_any_x86_compiler():
    """The AVX-512 build is chosen at run time where the CPU has it; where it does not (this CI's
    AVX2 machines) it must still compile, so that a change cannot break it unseen (on a machine
    with AVX-512 the tests above run it against the reference and the invariants)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX-512 is an x86-64 instruction set")
    assert native_build.build("paged_attention", "avx512").exists()


def test_native_attention_never_reads_outside_a_rows_context(isa):
    case = AttentionCase(((45, 1), (100, 20), (33, 33), (16, 1)), 8, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=3)
    before = native_attention.paged_attention(*batch.args(), isa=isa)
    used = set()
    for b, (ctx, _) in enumerate(case.requests):
        used |= set(batch.block_tables[b, : (ctx + case.block_size - 1) // case.block_size].tolist())
    unused = [i for i in range(batch.k_cache.shape[0]) if i not in used]
    assert unused
    for cache in (batch.k_cache, batch.v_cache):
        cache[unused] = float("nan")
        for b, (ctx, _) in enumerate(case.requests):  # past the last position, in the last block
            cache[int(batch.block_tables[b, (ctx - 1) // case.block_size]), ctx % case.block_size or 16 :] = (
                float("nan")
            )
    after = native_attention.paged_attention(*batch.args(), isa=isa)
    assert torch.equal(after, before)


def test_strided_queries_are_read_where_they_are(isa):
    """The model hands attention a view of its fused QKV projection: rows of Hq*D + 2*Hk*D floats."""
    case = AttentionCase(((50, 1), (70, 7), (20, 20)), 8, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=8)
    t, hq, d = batch.q.shape
    fused = torch.randn(t, hq * d + 2 * 2 * d)
    fused[:, : hq * d] = batch.q.reshape(t, hq * d)
    view = fused[:, : hq * d].view(t, hq, d)
    assert not view.is_contiguous()
    args = list(batch.args())
    args[0] = view
    got = native_attention.paged_attention(*args, isa=isa)
    assert torch.equal(got, native_attention.paged_attention(*batch.args(), isa=isa))


def test_every_row_runs_native_where_the_kernel_takes_the_shapes(monkeypatch):
    if native_attention.library() is None:
        pytest.fail("the native kernel did not build on this machine")
    case = AttentionCase(((90, 1), (100, 8), (64, 64), (300, 40), (7, 0)), 8, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=2)
    monkeypatch.setattr(torch_path, "paged_attention", lambda *a, **k: pytest.fail("the torch path ran"))
    got = native_attention.paged_attention(*batch.args(), isa=native_build.chosen_isa())
    torch.testing.assert_close(got, reference_attention(*batch.args()), rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_runs_on_the_torch_path(monkeypatch):
    case = MIXED_CASES[0]
    bf16 = make_paged_batch(case, torch.bfloat16, seed=1)
    assert not native_attention.takes(bf16.q, bf16.k_cache, bf16.v_cache)
    assert torch.equal(
        native_attention.paged_attention(*bf16.args()), torch_path.paged_attention(*bf16.args())
    )
    odd = make_paged_batch(AttentionCase(((20, 1), (9, 9)), 4, 2, 24, 16), torch.float32, seed=1)  # D % 16
    assert not native_attention.takes(odd.q, odd.k_cache, odd.v_cache)
    assert torch.equal(native_attention.paged_attention(*odd.args()), torch_path.paged_attention(*odd.args()))
    f32 = make_paged_batch(case, torch.float32, seed=1)
    monkeypatch.setenv("LLMSERVE_NATIVE_ATTENTION", "0")
    assert native_attention.prepare().startswith("torch")
    assert torch.equal(native_attention.paged_attention(*f32.args()), torch_path.paged_attention(*f32.args()))


def test_the_cpu_backend_runs_the_native_wrapper_and_says_so(caplog):
    assert TORCH_KERNELS.paged_attention is native_attention.paged_attention
    with caplog.at_level(logging.INFO, logger="kernels.backend"):
        select_kernels("cpu")
    isa = native_build.chosen_isa()
    attention = (
        f"native ({isa})" if isa in native_attention.FASTER_THAN_TORCH else "torch (native measured slower"
    )
    assert f"paged attention {attention}" in caplog.text
    assert f"rms_norm and rotary native ({isa})" in caplog.text


def test_attention_runs_native_only_where_it_measured_faster_unless_forced(monkeypatch):
    batch = make_paged_batch(MIXED_CASES[0], torch.float32, seed=4)
    calls = []
    real = torch_path.paged_attention
    monkeypatch.setattr(torch_path, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(native_build, "chosen_isa", lambda: "generic")
    assert native_attention.prepare().startswith("torch (native measured slower on generic")
    native_attention.paged_attention(*batch.args())
    assert calls == [1]
    monkeypatch.setenv("LLMSERVE_NATIVE_ATTENTION", "1")
    if native_attention.library() is not None:
        native_attention.paged_attention(*batch.args())
        assert calls == [1]  # forced: native, whatever the instruction set
    monkeypatch.setattr(native_build, "chosen_isa", lambda: "avx512")
    monkeypatch.setenv("LLMSERVE_NATIVE_ATTENTION", "auto")
    assert native_attention.enabled()


def test_instruction_set_choice(monkeypatch):
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    assert ISAS[-1] == "generic" and native_build.chosen_isa() == ISAS[0]
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "generic")
    assert native_build.chosen_isa() == "generic"
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        native_build.chosen_isa()
    monkeypatch.setattr(native_build, "supported_isas", lambda: ["avx2", "generic"])
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks it"):
        native_build.chosen_isa()


def _forget_libraries() -> None:
    native_build.forget_loads()
    native_attention._library.cache_clear()
    native_elementwise._library.cache_clear()


def test_without_a_compiler_the_build_says_why_and_nothing_is_cached(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        native_build.build("paged_attention", "generic")
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="failed on paged_attention.c"):
        native_build.build("paged_attention", "generic")
    assert list(tmp_path.iterdir()) == []  # no half-written library left for another process
    _forget_libraries()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu.native_build"):
            assert native_build.load_or_none("paged_attention", "generic") is None
        assert "the torch path runs instead" in caplog.text
    finally:
        _forget_libraries()


def _build_failure_warnings(caplog) -> list[str]:
    """Every layer of a 4-layer model's forward, twice: attention, RMSNorm, SiLU-and-mul, each checked
    against its reference; what the build logged as warnings."""
    case = AttentionCase(((40, 1), (30, 30)), 4, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=3)
    x, w = torch.randn(5, 64), torch.rand(64)
    with caplog.at_level(logging.DEBUG, logger="kernels.cpu.native_build"):
        for _ in range(2 * 4):
            got = native_attention.paged_attention(*batch.args())
            torch.testing.assert_close(got, reference_attention(*batch.args()), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                native_elementwise.rms_norm(x, w, 1e-6)[0], rmsnorm.rms_norm(x, w, 1e-6)[0]
            )
            gate_up = torch.randn(5, 128)
            torch.testing.assert_close(
                native_elementwise.silu_and_mul(gate_up), activation.silu_and_mul(gate_up)
            )
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_failing_compiler_is_reported_once_then_the_torch_path_runs(monkeypatch, tmp_path, caplog):
    """``CC=false``: one warning naming the compiler, for all kernels, layers and calls."""
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    _forget_libraries()
    try:
        warnings = _build_failure_warnings(caplog)
    finally:
        _forget_libraries()
    assert len(warnings) == 1, warnings
    assert "compiler false" in warnings[0] and "torch path" in warnings[0], warnings[0]
    assert list(tmp_path.iterdir()) == []


def test_a_compile_error_is_reported_once_with_the_compilers_message(monkeypatch, tmp_path, caplog):
    """A broken flag (an unknown -f option): the compiler's own error, once."""
    import shutil

    src = tmp_path / "native"
    shutil.copytree(native_build.SOURCE_DIR, src)
    monkeypatch.setattr(native_build, "SOURCE_DIR", src)
    monkeypatch.setattr(native_build, "_COMMON", [*native_build._COMMON, "-fno-such-flag-at-all"])
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    _forget_libraries()
    try:
        warnings = _build_failure_warnings(caplog)
    finally:
        _forget_libraries()
    assert len(warnings) == 1, warnings
    assert f"compiler {native_build.compiler()}" in warnings[0] and "no-such-flag" in warnings[0], warnings[0]


def test_a_build_is_cached_by_source_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path))
    first = native_build.build("paged_attention", "generic")
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native_build.build("paged_attention", "generic") == first and first.stat().st_mtime_ns == mtime


def test_a_changed_header_is_a_new_build(monkeypatch, tmp_path):
    import shutil

    src = tmp_path / "native"
    shutil.copytree(native_build.SOURCE_DIR, src)
    monkeypatch.setattr(native_build, "SOURCE_DIR", src)
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    first = native_build.build("paged_attention", "generic")
    header = src / "fast_exp.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    second = native_build.build("paged_attention", "generic")
    assert second != first and first.exists() and second.exists()


# --- RMSNorm and rotary, fused ---------------------------------------------------------------


@pytest.fixture(params=ISAS)
def elementwise_isa(request):
    if native_elementwise.library(request.param) is None:
        pytest.fail(f"the native elementwise kernels did not build for {request.param}")
    return request.param


@pytest.mark.parametrize("rows,dim", [(0, 64), (1, 512), (37, 100), (300, 512), (5, 4096)])
def test_fused_rms_norm_equals_the_reference(elementwise_isa, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x, r = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, generator=g)
    out, res = native_elementwise.rms_norm(x, w, 1e-6, r, isa=elementwise_isa)
    want, want_res = rmsnorm.rms_norm(x, w, 1e-6, r)
    assert torch.equal(res, want_res)  # x + residual: one rounding either way
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    alone, same = native_elementwise.rms_norm(x, w, 1e-6, isa=elementwise_isa)
    assert same is x
    torch.testing.assert_close(alone, rmsnorm.rms_norm(x, w, 1e-6)[0], rtol=1e-5, atol=1e-5)
    if rows > 1:  # a row alone is the same bits as in the batch
        one, _ = native_elementwise.rms_norm(x[1:2], w, 1e-6, r[1:2], isa=elementwise_isa)
        assert torch.equal(one[0], out[1])


@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 8, 2, 64), (50, 4, 4, 128), (7, 6, 3, 32), (0, 2, 1, 16)])
def test_fused_rotary_equals_the_reference_on_qkv_views(elementwise_isa, tokens, hq, hk, d):
    g = torch.Generator().manual_seed(tokens + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    cos_sin = rotary.rope_cos_sin_cache(rotary.rope_inv_freq(d, 10000.0), 2048)
    for positions in (
        torch.randint(0, 2048, (tokens,), generator=g),
        torch.arange(tokens, dtype=torch.int32),
    ):
        got_q, got_k = native_elementwise.apply_rotary(positions, q, k, cos_sin, isa=elementwise_isa)
        want_q, want_k = rotary.apply_rotary(positions, q, k, cos_sin)
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,d", [(0, 64), (1, 1408), (37, 100), (300, 1408), (3, 7)])
def test_fused_silu_and_mul_equals_the_reference(elementwise_isa, rows, d):
    g = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, 2 * d, generator=g) * 6
    if rows:  # zeros of both signs, and gates far past where e^-|g| under- or overflows naively
        x[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    got = native_elementwise.silu_and_mul(x, isa=elementwise_isa)
    torch.testing.assert_close(got, activation.silu_and_mul(x), rtol=1e-6, atol=1e-6)
    if rows > 1:  # a row alone is the same bits as in the batch
        assert torch.equal(native_elementwise.silu_and_mul(x[1:2], isa=elementwise_isa)[0], got[1])
    assert torch.equal(native_elementwise.silu_and_mul(x.view(1, rows, 2 * d), isa=elementwise_isa)[0], got)


def test_silu_and_mul_runs_native_on_avx512_and_avx2_only(monkeypatch):
    x = torch.randn(4, 32)
    calls = []
    real = activation.silu_and_mul
    monkeypatch.setattr(activation, "silu_and_mul", lambda t: calls.append(1) or real(t))
    monkeypatch.setattr(native_build, "chosen_isa", lambda: "generic")
    native_elementwise.silu_and_mul(x)
    assert calls == [1]
    assert "silu_and_mul torch (native measured slower)" in native_elementwise.prepare()
    for isa in ("avx512", "avx2"):
        if isa not in native_build.supported_isas():
            continue
        monkeypatch.setattr(native_build, "chosen_isa", lambda isa=isa: isa)
        native_elementwise.silu_and_mul(x)
        assert calls == [1], f"{isa}: torch's SiLU ran"
        assert native_elementwise.prepare().endswith("silu_and_mul native")
    native_elementwise.silu_and_mul(x[:, ::2])  # strided: torch's
    assert calls == [1, 1]


@pytest.mark.parametrize("module", ["elementwise", "attention"])
def test_the_default_library_follows_the_chosen_instruction_set(module, monkeypatch):
    """``library()`` (no instruction set named: the chosen one) asks for the choice on every call:
    its first call under another choice (``generic``, forced or in a test) does not keep that build
    for the process. It did: a test that ran first left the Python loop's SiLU on the generic build
    while the native loop's fused down projection ran the AVX-512 one (1 ulp apart; CI failed)."""
    library = native_elementwise.library if module == "elementwise" else native_attention.library
    monkeypatch.setattr(native_build, "chosen_isa", lambda: "generic")
    generic = library()
    assert generic is library("generic")
    monkeypatch.undo()
    for isa in native_build.supported_isas():
        monkeypatch.setenv("LLMSERVE_CPU_ISA", isa)
        assert library() is library(isa)
        assert (library() is generic) == (isa == "generic")


def test_what_the_fused_kernels_do_not_take_runs_the_reference(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    assert torch.equal(native_elementwise.rms_norm(x, w, 1e-6)[0], rmsnorm.rms_norm(x, w, 1e-6)[0])
    strided = torch.randn(9, 128, generator=g)[:, ::2]
    w32 = w.float()
    assert torch.equal(
        native_elementwise.rms_norm(strided, w32, 1e-6)[0], rmsnorm.rms_norm(strided, w32, 1e-6)[0]
    )
    monkeypatch.setenv("LLMSERVE_NATIVE_ELEMENTWISE", "0")
    x32 = x.float()
    assert torch.equal(native_elementwise.rms_norm(x32, w32, 1e-6)[0], rmsnorm.rms_norm(x32, w32, 1e-6)[0])
    assert native_elementwise.prepare().startswith("reference")


def test_fused_rotary_refuses_a_position_outside_the_table():
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos_sin = rotary.rope_cos_sin_cache(rotary.rope_inv_freq(16, 10000.0), 8)
    with pytest.raises(IndexError, match=r"rotary position 8 outside \[0, 8\)"):
        native_elementwise.apply_rotary(torch.tensor([3, 8]), q, k, cos_sin)
    with pytest.raises(IndexError, match="rotary position -1"):
        native_elementwise.apply_rotary(torch.tensor([-1, 2]), q, k, cos_sin)


def test_the_native_wrapper_refuses_what_the_kernel_would_read_out_of_bounds(isa):
    """The kernel takes raw pointers: a block id outside the cache, a context longer than its table,
    a value cache of another dtype or shape, or query offsets that do not add up are errors naming
    the input before any pointer is passed."""
    case = AttentionCase(((45, 1), (100, 20), (33, 33)), 8, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=5)
    q, k_cache, v_cache, tables, lens, qsl, scale = batch.args()
    native_attention.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale, isa=isa)
    bad_tables = tables.clone()
    bad_tables[1, 0] = k_cache.shape[0]  # one past the last block
    with pytest.raises(IndexError, match="block table entry"):
        native_attention.paged_attention(q, k_cache, v_cache, bad_tables, lens, qsl, scale, isa=isa)
    bad_tables[1, 0] = -1
    with pytest.raises(IndexError, match="block table entry -1"):
        native_attention.paged_attention(q, k_cache, v_cache, bad_tables, lens, qsl, scale, isa=isa)
    edited, kept = tables.clone(), int(tables[1, 0])
    native_attention.paged_attention(q, k_cache, v_cache, edited, lens, qsl, scale, isa=isa)
    edited[1, 0] = k_cache.shape[0]  # the same tensor changed in place is checked again
    with pytest.raises(IndexError, match="block table entry"):
        native_attention.paged_attention(q, k_cache, v_cache, edited, lens, qsl, scale, isa=isa)
    assert int(tables[1, 0]) == kept
    long = lens.clone()
    long[0] = tables.shape[1] * case.block_size + 1
    with pytest.raises(IndexError, match="overruns its block table"):
        native_attention.paged_attention(q, k_cache, v_cache, batch.block_tables, long, qsl, scale, isa=isa)
    with pytest.raises(ValueError, match="v_cache"):
        native_attention.paged_attention(
            q, k_cache, v_cache[:-1], batch.block_tables, lens, qsl, scale, isa=isa
        )
    with pytest.raises(ValueError, match="query_start_loc"):
        native_attention.paged_attention(
            q[:-1], k_cache, v_cache, batch.block_tables, lens, qsl, scale, isa=isa
        )


def test_the_native_wrapper_refuses_a_head_size_or_context_the_kernel_would_overrun(isa):
    """A cache whose head size is not the queries' (the kernel walks the queries' head size through
    each cache row), or a seq_lens entry shorter than its sequence's queries (they would sit before
    position 0): errors naming the input, whichever metadata was checked before."""
    case = AttentionCase(((45, 1), (100, 20), (33, 33)), 8, 2, 64, 16)
    q, k_cache, v_cache, tables, lens, qsl, scale = make_paged_batch(case, torch.float32, seed=6).args()
    native_attention.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale, isa=isa)
    narrow_k, narrow_v = k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous()
    with pytest.raises(ValueError, match="head size"):
        native_attention.paged_attention(q, narrow_k, narrow_v, tables, lens, qsl, scale, isa=isa)
    short = lens.clone()
    short[1] = 19  # 20 queries this step
    with pytest.raises(ValueError, match=r"seq_lens\[1\] is 19, fewer than its 20 query tokens"):
        native_attention.paged_attention(q, k_cache, v_cache, tables, short, qsl, scale, isa=isa)
    short[1] = 100
    short[2] = -1
    with pytest.raises(ValueError, match=r"seq_lens\[2\] is -1"):
        native_attention.paged_attention(q, k_cache, v_cache, tables, short, qsl, scale, isa=isa)


# --- the step's work list ------------------------------------------------------------------------


def test_a_steps_work_list_is_built_once_for_all_its_layers_and_grows_when_needed(isa):
    """Every layer of a step passes the same metadata: the work items are built for the first layer
    only, into buffers the next steps reuse (grown for a bigger step), and each layer's output is
    the same bits as with items built for that call alone (and the reference within rounding)."""
    small = make_paged_batch(AttentionCase(((40, 1), (30, 30)), 8, 2, 64, 16), torch.float32, seed=1)
    big = make_paged_batch(
        AttentionCase(((300, 1), (200, 37), (64, 64), (513, 1), (100, 9)), 8, 2, 64, 16),
        torch.float32,
        seed=2,
    )
    other = make_paged_batch(AttentionCase(((41, 1), (30, 30)), 8, 2, 64, 16), torch.float32, seed=1)
    for batch in (small, big, small, other):
        q, k_cache, v_cache, tables, lens, qsl, scale = batch.args()
        layers = [(k_cache, v_cache)] + [
            (torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(7)
        ]
        before = native_attention.work_list_builds(isa)
        outs = [
            native_attention.paged_attention(q, k, v, tables, lens, qsl, scale, isa=isa) for k, v in layers
        ]
        assert native_attention.work_list_builds(isa) == before + 1, "not built exactly once for 8 layers"
        for (k, v), got in zip(layers, outs, strict=True):
            # A decode of 1 context position first: the list is built again for the next call alone.
            one = (torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
            native_attention.paged_attention(q[:1].contiguous(), k, v, tables[:1], *one, scale, isa=isa)
            alone = native_attention.paged_attention(q, k, v, tables, lens, qsl, scale, isa=isa)
            assert torch.equal(got, alone)
            ref = reference_attention(q, k, v, tables, lens, qsl, scale)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _tiles_or_skip():
    if "avx512" not in ISAS or not native_attention.amx_tiles(True, "avx512", (torch.float32,)):
        native_attention.amx_tiles(False, "avx512", (torch.float32,))
        pytest.skip("this machine does not grant AMX-BF16 tiles (amx.h's probe)")


@pytest.fixture
def tiles():
    _tiles_or_skip()
    yield
    native_attention.amx_tiles(False, "avx512", (torch.float32,))


def _wrong_orders(products):
    """A product dropped, and the first two of C1 in the other order: each must differ from the
    kernel on data whose low parts matter."""
    p = products
    return p[:-1], (p[0], p[2], p[1], *p[3:])


@pytest.mark.parametrize("g,n,d", [(7, 256, 64), (16, 100, 128), (1, 17, 32), (12, 256, 256)])
def test_tile_scores_are_the_numpy_statement_of_the_tile_order(tiles, g, n, d):
    """The tile path's q . k (scores of G queries at n positions, the ones decodes and chunks both
    use) bit-equal to amx_scores_reference: the three-part splits, the six products per 32 dims in
    order into two sums (each TDPBF16PS two fp32 chains from zero, then C + (E + O)), then
    (C0 + C1) * scale; and a statement with a product dropped or two swapped differs, so the
    equality shows the order. Within fp32 rounding of the exact dot products."""
    import numpy as np

    rng = np.random.default_rng(g * 1000 + n)
    # mixed magnitudes and signs: the low parts and the order of the sums show in the bits
    q = (rng.standard_normal((g, d)) * np.exp2(rng.integers(-3, 4, (g, d)))).astype(np.float32)
    k = (rng.standard_normal((n, d)) * np.exp2(rng.integers(-3, 4, (n, d)))).astype(np.float32)
    scale = d**-0.5
    got = native_attention.amx_scores(q, k, scale)
    assert got is not None
    ref = native_attention.amx_scores_reference(q, k, scale)
    assert np.array_equal(got, ref), f"{int((got != ref).sum())} scores differ from the tile order"
    if g * n >= 1500:  # enough scores that a wrong order shows in some
        for wrong in _wrong_orders(native_attention.AMX_SCORE_PRODUCTS):
            assert not np.array_equal(got, native_attention.amx_scores_reference(q, k, scale, wrong))
    exact = (q.astype(np.float64) @ k.T.astype(np.float64)) * scale
    bound = 4 * 2.0**-24 * (np.abs(q.astype(np.float64)) @ np.abs(k.T.astype(np.float64))) * scale
    assert (np.abs(got - exact) <= bound + 1e-30).all()


@pytest.mark.parametrize("g,n,d", [(7, 256, 64), (16, 100, 128), (3, 31, 32)])
def test_tile_weighted_v_is_the_numpy_statement_of_the_tile_order(tiles, g, n, d):
    """The tile path's pass over V (G rows of softmax weights over n V rows) bit-equal to
    amx_weighted_v_reference (pairs of positions interleaved: the even and the odd positions of
    each 32 are the two chains); a dropped or swapped product differs."""
    import numpy as np

    rng = np.random.default_rng(g + n)
    w = rng.random((g, n)).astype(np.float32) ** 3  # numerators in (0, 1], some small
    v = (rng.standard_normal((n, d)) * np.exp2(rng.integers(-3, 4, (n, d)))).astype(np.float32)
    got = native_attention.amx_weighted_v(w, v)
    assert got is not None
    ref = native_attention.amx_weighted_v_reference(w, v)
    assert np.array_equal(got, ref), f"{int((got != ref).sum())} sums differ from the tile order"
    if g * d >= 400:  # enough sums that a wrong order shows in some
        for wrong in _wrong_orders(native_attention.AMX_V_PRODUCTS):
            assert not np.array_equal(got, native_attention.amx_weighted_v_reference(w, v, wrong))
    exact = w.astype(np.float64) @ v.astype(np.float64)
    bound = 4 * n * 2.0**-24 * (np.abs(w.astype(np.float64)) @ np.abs(v.astype(np.float64)))
    assert (np.abs(got - exact) <= bound + 1e-30).all()


def test_the_tile_path_runs_only_when_switched_on_and_changes_the_bits(tiles):
    """LLMSERVE_AMX_ATTENTION (here the switch the tests use) chooses the path: off, the fp32 path's
    bits; on, the tiles' (a different order: not the same bits on this data), both within tolerance
    of the reference."""
    case = AttentionCase(((700, 1), (600, 40)), 14, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=3)
    on = native_attention.paged_attention(*batch.args(), isa="avx512")
    native_attention.amx_tiles(False, "avx512", (torch.float32,))
    off = native_attention.paged_attention(*batch.args(), isa="avx512")
    assert not native_attention.amx_tiles(None, "avx512", (torch.float32,))
    assert not torch.equal(on, off), "the tile path did not run"
    ref = reference_attention(*batch.args())
    for got in (on, off):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: c.label)
def test_windowed_and_capped_layers_equal_the_reference_and_their_decodes(isa, case):
    """Sliding windows (released blocks in the tables name a page of NaNs: never read) and
    soft-capped scores, on every path (the tile path's masks and caps included): within tolerance
    of the reference, and every chunk row bit-equal to the decode of its own position."""
    batch = make_paged_batch(case, torch.float32, seed=23)
    q, k_cache, v_cache, tables, lens, qsl, scale = batch.args()
    got = native_attention.paged_attention(*batch.args(), **batch.layer, isa=isa)
    torch.testing.assert_close(got, reference_attention(*batch.args(), **batch.layer), rtol=1e-5, atol=1e-5)
    starts = qsl.tolist()
    for b, (_, q_len) in enumerate(case.requests):
        for i in range(q_len):
            ctx = int(lens[b]) - q_len + i + 1
            row = starts[b] + i
            decode = native_attention.paged_attention(
                q[row : row + 1],
                k_cache,
                v_cache,
                tables[b : b + 1],
                torch.tensor([ctx], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32),
                scale,
                **batch.layer,
                isa=isa,
            )
            assert torch.equal(decode[0], got[row]), f"sequence {b} row {i} differs as a decode"


def _runs_split_k(q_len, ctx, rep, isa):
    """The kernel's route for a sequence (split_k_rows in paged_attention.c): a decode, or a few
    rows at depth whose chunk tiles (2W lanes each: W 16, 8, 4) would leave over a quarter idle."""
    tile = 2 * {"avx512": 16, "avx2": 8, "generic": 4}[isa]
    lanes = -(-q_len * rep // tile) * tile
    return q_len == 1 or (1 < q_len <= 16 and ctx >= 512 and 4 * q_len * rep <= 3 * lanes)


@pytest.mark.parametrize("heads", [(14, 2), (4, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize(
    "layer", [{}, {"window": 300}, {"softcap": 30.0}, {"window": 200, "softcap": 5.0}], ids=str
)
def test_a_few_rows_at_depth_run_split_k_with_each_rows_decode_bits(isa, layer, heads):
    """A sequence with a few query rows at depth (a speculative verify, a short chunk: up to 16 rows
    after 512 positions, where a chunk's tiles would leave lanes idle) runs as a decode does, an
    item per KV partition holding all its rows, each row with its own causal limit and window,
    merged per row: every row's bits equal to the same row in a long chunk (the tiles), to the
    decode of its own position, alone or beside other sequences, at one thread and two, for rows
    whose contexts end on either side of a partition edge (1280). Qwen2.5-0.5B's geometry (7 query
    heads per KV head, head size 64) and one query head per KV head (split-K on every build)."""
    hq, hk = heads
    case = AttentionCase(((1300, 60), (700, 1), (600, 40), (900, 5)), hq, hk, 64, 16, **layer)
    batch = make_paged_batch(case, torch.float32, seed=29)
    q, k_cache, v_cache, tables, lens, qsl, scale = batch.args()
    kernel_isa = isa.partition("+")[0]

    def attend(qq, tb, ctx, q_lens, threads):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            return native_attention.paged_attention(
                qq,
                k_cache,
                v_cache,
                tb,
                torch.tensor(ctx, dtype=torch.int32),
                starts,
                scale,
                **batch.layer,
                isa=isa,
            )
        finally:
            torch.set_num_threads(old)

    whole = attend(q[:60], tables[:1], [1300], [60], 1)  # 60 rows: a chunk's tiles
    assert native_attention.split_rows(isa) == 0, "a 60-row chunk ran split-K"
    torch.testing.assert_close(
        whole, reference_attention(*batch.args(), **batch.layer)[:60], rtol=1e-5, atol=1e-5
    )
    # row i sees 1241 + i positions: row 39 the partition before 1280, row 40 one position after it
    routes = []
    for rows in (
        range(0, 5),
        range(36, 41),
        range(38, 40),
        range(39, 41),
        range(34, 37),
        range(34, 50),
        range(54, 60),
    ):
        ctx = 1240 + rows.stop
        split = _runs_split_k(len(rows), ctx, hq // hk, kernel_isa)
        routes.append(split)
        for threads in (1, 2):
            got = attend(q[rows.start : rows.stop], tables[:1], [ctx], [len(rows)], threads)
            assert native_attention.split_rows(isa) == (len(rows) if split else 0), (
                f"rows {rows}: another route"
            )
            assert torch.equal(got, whole[rows.start : rows.stop]), f"rows {rows} at {threads} threads differ"
        # beside a decode, a long chunk and another few rows
        mixed = attend(
            torch.cat([q[60:61], q[rows.start : rows.stop], q[61:101], q[101:106]]),
            torch.cat([tables[1:2], tables[:1], tables[2:4]]),
            [700, ctx, 600, 900],
            [1, len(rows), 40, 5],
            2,
        )
        assert torch.equal(mixed[1 : 1 + len(rows)], whole[rows.start : rows.stop]), f"rows {rows} in a batch"
    for i in (0, 39, 40, 59):  # the decode of its own position
        decode = attend(q[i : i + 1], tables[:1], [1241 + i], [1], 2)
        assert torch.equal(decode[0], whole[i]), f"row {i} differs as a decode"
    # below the depth, a few rows stay a chunk
    attend(q[:5], tables[:1], [300], [5], 2)
    assert native_attention.split_rows(isa) == 0
    if hq == hk or kernel_isa == "avx512":
        assert sum(routes) >= 4, "too few of the cases ran split-K to test it"
