"""A fixed number of adapter slots on the device (``max_loras``), each holding one adapter's A and B
for every layer, zero padded to ``max_lora_rank``. Adapters beyond the slots wait in host memory and
are copied in when a step needs them, evicting the least recently used slot whose adapter no
running request uses (the scheduler never runs more distinct adapters than there are slots).

The stacks follow the decoder's fused projections (``qkv``, ``o``, ``gate_up``, ``down``): per
layer and fused projection, ``A [slots, modules * R, in]`` and ``B [slots, fused_out, modules * R]``
with B block-structured (module j's B reads only module j's A rows and writes only its own output
columns), so one shrink and one expand per fused projection serve all of its modules. Rank columns
are interleaved (column ``i * modules + j`` is rank i of module j), so an adapter of rank r uses
exactly the first ``r * modules`` columns and a step reads no more than its largest rank needs."""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.geometry import FUSED, Target, shard_pair
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard


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
        spec: ModelSpec | None = None,
        shard: Shard | None = None,
    ):
        self.num_slots, self.max_rank, self.geometry = num_slots, max_rank, geometry
        self.spec, self.shard = spec, shard or Shard()  # with tensor parallelism: this rank's part
        self.on_load = None  # (slot, adapter) -> None: tells tensor-parallel workers to load it too
        # Only the fused projections whose modules the geometry has (all of them in the engine).
        self.fused = {f: ms for f, ms in FUSED.items() if all(m in geometry for m in ms)}
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(num_layers):
            layer = {}
            for f, modules in self.fused.items():
                n_in = geometry[modules[0]].in_features
                n_out = sum(geometry[m].out_features for m in modules)
                cols = len(modules) * max_rank
                layer[f] = (
                    torch.zeros(num_slots, cols, n_in, dtype=dtype, device=device),
                    torch.zeros(num_slots, n_out, cols, dtype=dtype, device=device),
                )
            self.stacks.append(layer)
        self.holder: list[tuple[str, int] | None] = [None] * num_slots  # (name, version) per slot
        self.modules: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets
        self.ranks: list[int] = [0] * num_slots
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # key -> slot, oldest first
        self.num_swaps = 0  # adapters copied in (first loads included)

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

    def load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        """A tensor-parallel worker's side: rank 0 chose the slot."""
        key = self.holder[slot]
        if key is not None:
            self._lru.pop(key, None)
        self._load(slot, adapter)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if self.on_load is not None:
            self.on_load(slot, adapter)
        r = adapter.rank
        for layer, stacks in enumerate(self.stacks):
            for f, modules in self.fused.items():
                a_stack, b_stack = stacks[f]
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                n = len(modules)
                for j, module in enumerate(modules):
                    w = adapter.weights.get((layer, module))
                    if w is None:
                        continue
                    t = self.geometry[module]
                    a, b = shard_pair(module, w[0], w[1], self.spec, self.shard) if self.spec else w
                    a_stack[slot, j : r * n : n].copy_(a)
                    b_stack[slot, t.offset : t.offset + t.out_features, j : r * n : n].copy_(b)
        key = (adapter.name, adapter.version)
        self.holder[slot] = key
        self.modules[slot] = adapter.modules
        self.ranks[slot] = adapter.rank
        self._lru[key] = slot
        self.num_swaps += 1
