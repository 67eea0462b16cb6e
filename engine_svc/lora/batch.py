"""One step's LoRA mapping: which adapter slot each flattened token uses, grouped once per step, and
the per-layer apply the decoder calls after each fused projection."""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.lora.geometry import FUSED, Target
from engine_svc.lora.slots import AdapterSlots
from kernels.reference.lora import TokenGroup, group_tokens


class LoRABatch:
    def __init__(
        self,
        slots: AdapterSlots,
        geometry: dict[str, Target],
        token_slots: np.ndarray,
        ranks: dict[int, int],
        kernel,
        device: torch.device,
    ):
        self.slots, self.geometry, self.kernel = slots, geometry, kernel
        groups = group_tokens(token_slots, ranks, device)
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        # Per target module, the groups whose adapter has weights there (others add nothing); a module
        # no adapter of the step targets is skipped whole.
        self.groups: dict[str, list[TokenGroup]] = {}
        self.max_rank: dict[str, int] = {}
        for module in geometry:
            mine = [g for g in groups if module in slots.modules[g.slot]]
            if mine:
                self.groups[module] = mine
                self.max_rank[module] = max(g.rank for g in mine)

    def apply(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's LoRA deltas of ``fused`` (a key of ``geometry.FUSED``) to ``out`` in place."""
        stacks = self.slots.stacks[layer]
        for module in FUSED[fused]:
            groups = self.groups.get(module)
            if groups is None:
                continue
            t = self.geometry[module]
            a, b = stacks[module]
            cols = out[:, t.offset : t.offset + t.out_features]
            self.kernel(cols, x, a, b, self.token_slots, groups, self.max_rank[module])
