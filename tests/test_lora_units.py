"""LoRA parts without a model: the batched torch apply against the one-token-at-a-time definition,
and the device slots' LRU (never evicting an adapter in use)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.geometry import Target
from engine_svc.lora.slots import AdapterSlots, SlotsExhausted
from kernels.lora_plan import plan_tokens
from kernels.reference.lora import lora_apply
from tests.lora_cases import LORA_CASES, lora_by_token, make_lora_case


@pytest.mark.parametrize("case", LORA_CASES, ids=[c[0] for c in LORA_CASES])
def test_batched_apply_equals_the_per_token_definition(case):
    c = make_lora_case(case, torch.float32, "cpu")
    want = lora_by_token(c)
    lora_apply(c.out, c.x, c.a, c.b, torch.from_numpy(c.token_slots), c.plan("cpu"), c.max_rank)
    torch.testing.assert_close(c.out, want, rtol=1e-5, atol=1e-5)


def test_plan_is_one_segment_per_adapter_and_a_slice_when_already_grouped():
    plan = plan_tokens(np.array([-1, 2, 2, 0, 2, -1, 0]))
    assert plan.rows.tolist() == [3, 6, 1, 2, 4] and plan.count == 5
    assert [(s.slot, s.start, s.end) for s in plan.segments] == [(0, 0, 2), (2, 2, 5)]
    grouped = plan_tokens(np.array([-1, 1, 1, 3]))
    assert grouped.rows == slice(1, 4) and [(s.slot, s.start, s.end) for s in grouped.segments] == [
        (1, 0, 2),
        (3, 2, 3),
    ]
    assert plan_tokens(np.array([-1, -1])).count == 0


def _adapter(name, version, value):
    a = torch.full((2, 4), float(value))
    b = torch.full((3, 2), float(value))
    return LoRAAdapter(name, "/x", 2, 1.0, frozenset({"o_proj"}), {(0, "o_proj"): (a, b)}, version)


def _slots(n):
    geometry = {"o_proj": Target("o_proj", "o", 4, 3, 0)}
    return AdapterSlots(n, 4, 1, geometry, torch.float32, torch.device("cpu"))


def test_slots_swap_in_by_lru_and_never_evict_in_use():
    slots = _slots(2)
    a, b, c = _adapter("a", 1, 1), _adapter("b", 2, 2), _adapter("c", 3, 3)
    slots.activate([a], set())
    slots.activate([b], {("a", 1)})
    assert slots.holder == [("a", 1), ("b", 2)]
    slots.activate([a], set())  # a is now the most recent: c replaces b
    got = slots.activate([c], set())
    assert slots.holder == [("a", 1), ("c", 3)] and got == {("c", 3): 1}
    # a is older than c now, but in use: b replaces c, not a.
    slots.activate([b], {("a", 1)})
    assert slots.holder == [("a", 1), ("b", 2)]
    a_stack, b_stack = slots.stacks[0]["o"]
    assert float(a_stack[1, :2].max()) == 2.0 and float(a_stack[1, 2:].abs().max()) == 0.0  # zero padded
    with pytest.raises(SlotsExhausted):
        slots.activate([c], {("a", 1), ("b", 2)})
    assert slots.num_swaps == 4  # a, b, c, b again


def test_fused_stacks_put_each_module_in_its_columns_and_rows():
    """q, k and v of one adapter in the fused qkv stack: module j's rank i is column i * 3 + j, and
    its B writes only its own output rows; the fused apply equals the three modules apart."""
    geometry = {
        "q_proj": Target("q_proj", "qkv", 4, 6, 0),
        "k_proj": Target("k_proj", "qkv", 4, 2, 6),
        "v_proj": Target("v_proj", "qkv", 4, 2, 8),
    }
    slots = AdapterSlots(2, 4, 1, geometry, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    weights = {
        (0, m): (torch.randn(3, 4, generator=gen), torch.randn(t.out_features, 3, generator=gen))
        for m, t in geometry.items()
        if m != "k_proj"
    }
    adapter = LoRAAdapter("a", "/x", 3, 1.0, frozenset({"q_proj", "v_proj"}), weights, 1)
    (slot,) = slots.activate([adapter], set()).values()
    x = torch.randn(5, 4, generator=gen)
    out = torch.zeros(5, 10)
    a, b = slots.stacks[0]["qkv"]
    lora_apply(out, x, a, b, None, plan_tokens(np.full(5, slot)), 3 * 3)
    want = torch.zeros(5, 10)
    for (_, m), (wa, wb) in weights.items():
        t = geometry[m]
        want[:, t.offset : t.offset + t.out_features] = x @ wa.T @ wb.T
    torch.testing.assert_close(out, want)


def test_lora_requests_info_is_served_as_vllm_serves_it():
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import EngineLoadCollector
    from llmserve_proto.engine.v1 import engine_pb2 as pb

    load = pb.Load(running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"], max_lora=4)
    registry = CollectorRegistry()
    registry.register(EngineLoadCollector(lambda: load))
    text = generate_latest(registry).decode()
    assert (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"}' in text
    )
    registry = CollectorRegistry()
    registry.register(EngineLoadCollector(lambda: pb.Load()))  # LoRA off: no family
    assert "lora_requests_info" not in generate_latest(registry).decode()
