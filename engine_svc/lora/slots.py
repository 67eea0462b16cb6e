"""A fixed number of adapter slots on the device (``max_loras``), each holding one adapter's A and B
for every layer and target, zero padded to ``max_lora_rank``. Adapters beyond the slots wait in host
memory and are copied in when a step needs them, evicting the least recently used slot whose adapter
no running request uses (the scheduler never runs more distinct adapters than there are slots)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.geometry import Target


class SlotsExhausted(RuntimeError):
    """Every slot holds an adapter in use: the scheduler let too many distinct adapters run."""


class AdapterSlots:
    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        num_layers: int,
        geometry: dict[str, Target],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots, self.max_rank = num_slots, max_rank
        # stacks[layer][module] = (A [slots, R, in], B [slots, out, R])
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {
                m: (
                    torch.zeros(num_slots, max_rank, t.in_features, dtype=dtype, device=device),
                    torch.zeros(num_slots, t.out_features, max_rank, dtype=dtype, device=device),
                )
                for m, t in geometry.items()
            }
            for _ in range(num_layers)
        ]
        self.holder: list[tuple[str, int] | None] = [None] * num_slots  # (name, version) per slot
        self.modules: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # key -> slot, oldest first
        self.num_swaps = 0  # adapters copied in (first loads included)

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        return self._lru.get((adapter.name, adapter.version))

    def activate(self, wanted: list[LoRAAdapter], in_use: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Make every adapter of ``wanted`` resident; returns (name, version) -> slot. Evicts only
        slots whose adapter is neither wanted now nor in ``in_use`` (by a running request)."""
        keys = {(a.name, a.version): a for a in wanted}
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)
        for key, adapter in keys.items():
            if key not in self._lru:
                self._load(self._free_slot(set(keys) | in_use), adapter)
        return {key: self._lru[key] for key in keys}

    def evict(self, name: str) -> None:
        """Forget every version of ``name`` (an unload); its slot is reused next."""
        for key in [k for k in self._lru if k[0] == name]:
            slot = self._lru.pop(key)
            self.holder[slot] = None
            self.modules[slot] = frozenset()

    def _free_slot(self, keep: set[tuple[str, int]]) -> int:
        for slot, key in enumerate(self.holder):
            if key is None:
                return slot
        for key, slot in self._lru.items():  # oldest first
            if key not in keep:
                del self._lru[key]
                return slot
        raise SlotsExhausted(f"all {self.num_slots} LoRA slots hold adapters in use")

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        r = adapter.rank
        for layer, stacks in enumerate(self.stacks):
            for module, (a_stack, b_stack) in stacks.items():
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                w = adapter.weights.get((layer, module))
                if w is not None:
                    a_stack[slot, :r].copy_(w[0])
                    b_stack[slot, :, :r].copy_(w[1])
        key = (adapter.name, adapter.version)
        self.holder[slot] = key
        self.modules[slot] = adapter.modules
        self._lru[key] = slot
        self.num_swaps += 1
