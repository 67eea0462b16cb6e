"""The fused rotary + KV-cache write (``llmserve_rotary_store_kv_f32`` in
``kernels/cpu/native/elementwise.c``) on every instruction set this CPU runs: against an independent
float64 reader (the rotation written out per element from the cos/sin table, the cache read back
slot by slot), the same bits as the two native calls it replaces, a token's result the same bits
alone as in a batch, nothing stored for a negative slot or outside a token's slot, and the
wrapper's checks and fallbacks."""

from __future__ import annotations

import pytest
import torch

from kernels.backend import REFERENCE_KERNELS, TORCH_KERNELS
from kernels.cpu import native_build, native_elementwise
from kernels.reference import kv_write, rotary

ISAS = native_build.supported_isas()
SENTINEL = 1234.5  # what the cache holds where nothing may be written


@pytest.fixture(params=ISAS)
def isa(request):
    if native_elementwise.library(request.param) is None:
        pytest.fail(f"the native elementwise kernels did not build for {request.param}")
    return request.param


def _case(tokens, hq, hk, d, *, num_blocks=6, block_size=4, seed=0, positions=None, slots=None):
    g = torch.Generator().manual_seed(seed + 31 * tokens + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g) * 2
    cos_sin = rotary.rope_cos_sin_cache(rotary.rope_inv_freq(d, 10000.0), 64)
    if positions is None:
        positions = torch.randint(0, 64, (tokens,), generator=g)
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    caches = [torch.full((num_blocks, block_size, hk, d), SENTINEL) for _ in range(2)]
    return qkv, positions, cos_sin, caches[0], caches[1], slots


def _float64_reader(qkv, positions, cos_sin, k_cache, slots, hq, hk):
    """(queries [T, Hq, D], keys [T, Hk, D], values [T, Hk, D]) as the kernel should make them,
    each element from its own formula in float64."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    half = d // 2
    x = qkv.double().view(t, hq + 2 * hk, d)
    cs = cos_sin.double()[positions.long()]  # [T, D]: cos of each frequency, then sin
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    rot = torch.empty_like(x[:, : hq + hk])
    a, b = x[:, : hq + hk, :half], x[:, : hq + hk, half:]
    rot[..., :half] = a * cos - b * sin
    rot[..., half:] = b * cos + a * sin
    return rot[:, :hq], rot[:, hq:], x[:, hq + hk :]


SHAPES = [(1, 9, 3, 64), (5, 4, 4, 128), (17, 6, 2, 2), (3, 3, 1, 6), (7, 2, 1, 18), (0, 4, 2, 16)]


@pytest.mark.parametrize("tokens,hq,hk,d", SHAPES)
def test_equals_a_float64_reader(isa, tokens, hq, hk, d):
    qkv, positions, cos_sin, kc, vc, slots = _case(tokens, hq, hk, d)
    q = native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, hq, hk, isa=isa)
    want_q, want_k, want_v = _float64_reader(qkv, positions, cos_sin, kc, slots, hq, hk)
    assert q.shape == (tokens, hq, d) and q.dtype == torch.float32
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(flat_k[s].double(), want_k[i], rtol=1e-5, atol=1e-5)
        assert torch.equal(flat_v[s], qkv[i, (hq + hk) * d :].view(hk, d))  # values: copied
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert bool((flat_k[untouched] == SENTINEL).all()) and bool((flat_v[untouched] == SENTINEL).all())


@pytest.mark.parametrize("tokens,hq,hk,d", SHAPES[:4])
def test_same_bits_as_rotary_then_the_cache_write(isa, tokens, hq, hk, d):
    qkv, positions, cos_sin, kc, vc, slots = _case(tokens, hq, hk, d, seed=3)
    q = native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, hq, hk, isa=isa)
    kc2, vc2 = torch.full_like(kc, SENTINEL), torch.full_like(vc, SENTINEL)
    q2, k2, v2 = kv_write.split_qkv(qkv, hq, hk, d)
    q2, k2 = native_elementwise.apply_rotary(positions, q2, k2, cos_sin, isa=isa)
    kv_write.write_kv(k2, v2, kc2, vc2, slots)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_a_token_alone_is_the_same_bits_as_in_a_batch(isa):
    hq, hk, d = 9, 3, 64
    qkv, positions, cos_sin, kc, vc, slots = _case(11, hq, hk, d, seed=5)
    q = native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, hq, hk, isa=isa)
    for i in (0, 4, 10):
        kc1, vc1 = torch.full_like(kc, SENTINEL), torch.full_like(vc, SENTINEL)
        one = native_elementwise.rotary_store_kv(
            qkv[i : i + 1].clone(), positions[i : i + 1], cos_sin, kc1, vc1, slots[i : i + 1], hq, hk, isa=isa
        )
        s = int(slots[i])
        assert torch.equal(one[0], q[i])
        assert torch.equal(kc1.view(-1, hk, d)[s], kc.view(-1, hk, d)[s])
        assert torch.equal(vc1.view(-1, hk, d)[s], vc.view(-1, hk, d)[s])


def test_rows_at_a_stride_and_negative_slots(isa):
    hq, hk, d = 4, 2, 16
    wide = torch.randn(6, (hq + 2 * hk) * d + 8)
    qkv = wide[:, : (hq + 2 * hk) * d]  # a row stride past its width
    _, positions, cos_sin, kc, vc, _ = _case(6, hq, hk, d)
    slots = torch.tensor([3, -1, 7, -1, 0, 9])
    q = native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, hq, hk, isa=isa)
    want_q, want_k, _ = _float64_reader(qkv, positions, cos_sin, kc, slots, hq, hk)
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    flat_k = kc.view(-1, hk, d)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(flat_k[s].double(), want_k[i], rtol=1e-5, atol=1e-5)
    written = {s for s in slots.tolist() if s >= 0}
    others = [s for s in range(flat_k.shape[0]) if s not in written]
    assert bool((flat_k[others] == SENTINEL).all()) and bool((vc.view(-1, hk, d)[others] == SENTINEL).all())


def test_refuses_a_position_or_slot_outside_its_table():
    qkv, positions, cos_sin, kc, vc, slots = _case(2, 4, 2, 16)
    with pytest.raises(IndexError, match=r"rotary position 64 outside \[0, 64\)"):
        native_elementwise.rotary_store_kv(qkv, torch.tensor([1, 64]), cos_sin, kc, vc, slots, 4, 2)
    with pytest.raises(IndexError, match="rotary position -1"):
        native_elementwise.rotary_store_kv(qkv, torch.tensor([-1, 0]), cos_sin, kc, vc, slots, 4, 2)
    with pytest.raises(IndexError, match="cache slot 24 outside the cache's 24 slots"):
        native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, torch.tensor([0, 24]), 4, 2)
    assert bool((kc == SENTINEL).all())  # nothing written by a refused call


def test_a_checked_steps_tensor_changed_in_place_is_checked_again():
    qkv, positions, cos_sin, kc, vc, slots = _case(2, 4, 2, 16)
    native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, 4, 2)
    slots[1] = 99
    with pytest.raises(IndexError, match="cache slot 99"):
        native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, 4, 2)


def test_what_the_kernel_does_not_take_runs_the_composition(monkeypatch):
    qkv, positions, cos_sin, kc, vc, slots = _case(3, 4, 2, 16)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = kv_write.rotary_store_kv(qkv, positions, cos_sin, want_kc, want_vc, slots, 4, 2)
    calls = []
    real = kv_write.rotary_store_kv
    monkeypatch.setattr(kv_write, "rotary_store_kv", lambda *a, **k: calls.append(1) or real(*a, **k))
    for bad in (
        dict(positions=positions.int()),  # int32 positions: the composition takes them
        dict(slots=slots.int()),  # int32 slots likewise
    ):
        args = dict(qkv=qkv, positions=positions, cos_sin=cos_sin, kc=kc.clone(), vc=vc.clone(), slots=slots)
        args.update(bad)
        q = native_elementwise.rotary_store_kv(
            args["qkv"], args["positions"], args["cos_sin"], args["kc"], args["vc"], args["slots"], 4, 2
        )
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    assert calls == [1, 1]
    monkeypatch.setenv("LLMSERVE_NATIVE_ELEMENTWISE", "0")
    native_elementwise.rotary_store_kv(qkv, positions, cos_sin, kc, vc, slots, 4, 2)
    assert calls == [1, 1, 1]


def test_each_bundle_rotates_and_stores():
    """The torch bundle runs the fused kernel; one without it (the references, Triton's) composes
    its own rotary and cache write; both leave the same cache."""
    assert TORCH_KERNELS.rotary_store_kv is native_elementwise.rotary_store_kv
    assert REFERENCE_KERNELS.rotary_store_kv is None
    qkv, positions, cos_sin, kc, vc, slots = _case(4, 6, 3, 32)
    kc2, vc2 = kc.clone(), vc.clone()
    q = TORCH_KERNELS.rotate_and_store(qkv, positions, cos_sin, kc, vc, slots, 6, 3)
    q2 = REFERENCE_KERNELS.rotate_and_store(qkv, positions, cos_sin, kc2, vc2, slots, 6, 3)
    torch.testing.assert_close(q, q2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc2, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc, vc2)
