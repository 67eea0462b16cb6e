"""One step's LoRA mapping: which adapter slot each flattened token uses, planned once per step,
and the per-layer apply the decoder calls after each fused projection."""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.lora.slots import AdapterSlots
from kernels.lora_plan import plan_tokens


class LoRABatch:
    def __init__(self, slots: AdapterSlots, token_slots: np.ndarray, ranks: dict[int, int], kernel, device):
        self.slots, self.kernel = slots, kernel
        self.token_slots_host = token_slots  # sent to tensor-parallel workers with the step
        self.plan = plan_tokens(token_slots, device)
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        # Per fused projection, the stack columns the step reads (its largest rank, interleaved over
        # the modules); a projection no adapter of the step targets is skipped whole.
        self.columns: dict[str, int] = {}
        for fused, modules in slots.fused.items():
            used = [r for s, r in ranks.items() if slots.modules[s].intersection(modules)]
            if used:
                self.columns[fused] = max(used) * len(modules)

    def apply(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's LoRA deltas of ``fused`` (a key of ``geometry.FUSED``) to ``out`` in place."""
        columns = self.columns.get(fused)
        if columns is None:
            return
        a, b = self.slots.stacks[layer][fused]
        self.kernel(out, x, a, b, self.token_slots, self.plan, columns)
