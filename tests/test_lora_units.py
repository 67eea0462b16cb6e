"""LoRA parts without a model: the batched torch apply against the one-token-at-a-time definition,
and the device slots' LRU (never evicting an adapter in use)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.geometry import Target
from engine_svc.lora.slots import AdapterSlots, SlotsExhausted
from kernels.lora_cases import LORA_CASES, lora_by_token, make_lora_case
from kernels.reference.lora import group_tokens, lora_apply


@pytest.mark.parametrize("case", LORA_CASES, ids=[c[0] for c in LORA_CASES])
def test_batched_apply_equals_the_per_token_definition(case):
    c = make_lora_case(case, torch.float32, "cpu")
    want = lora_by_token(c)
    lora_apply(c.out, c.x, c.a, c.b, torch.from_numpy(c.token_slots), c.groups("cpu"), c.max_rank)
    torch.testing.assert_close(c.out, want, rtol=1e-5, atol=1e-5)


def test_groups_are_one_per_adapter_and_slices_when_contiguous():
    groups = group_tokens(np.array([-1, 2, 2, 0, 2, -1, 0]), {0: 4, 2: 8})
    assert [(g.slot, g.rank) for g in groups] == [(0, 4), (2, 8)]
    assert groups[0].rows.tolist() == [3, 6] and groups[1].rows.tolist() == [1, 2, 4]
    (only,) = group_tokens(np.array([-1, 1, 1, 1]), {1: 2})
    assert only.rows == slice(1, 4)


def _adapter(name, version, value):
    a = torch.full((2, 4), float(value))
    b = torch.full((3, 2), float(value))
    return LoRAAdapter(name, "/x", 2, 1.0, frozenset({"q_proj"}), {(0, "q_proj"): (a, b)}, version)


def _slots(n):
    geometry = {"q_proj": Target("q_proj", "qkv", 4, 3, 0)}
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
    a_stack, b_stack = slots.stacks[0]["q_proj"]
    assert float(a_stack[1, :2].max()) == 2.0 and float(a_stack[1, 2:].abs().max()) == 0.0  # zero padded
    with pytest.raises(SlotsExhausted):
        slots.activate([c], {("a", 1), ("b", 2)})
    assert slots.num_swaps == 4  # a, b, c, b again
