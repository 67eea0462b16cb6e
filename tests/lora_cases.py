"""Inputs for checking a batched LoRA apply against its definition (one token at a time): a mix of
base tokens and tokens of several slots, in contiguous and interleaved groups, with ranks below the
padded stack rank. Shared by the interpreter tests and the GPU check."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.lora_plan import plan_tokens

# (name, tokens, in_features, out_features, slots, padded rank, ranks per slot, token pattern)
LORA_CASES = [
    ("decode-mixed", 9, 64, 96, 3, 16, (4, 16, 8), "interleaved"),
    ("prefill-grouped", 37, 128, 48, 2, 8, (8, 2), "grouped"),
    ("wide-out-slice", 5, 256, 1024, 4, 32, (32, 1, 16, 8), "interleaved"),
]


@dataclass
class LoRACase:
    name: str
    x: torch.Tensor
    out: torch.Tensor  # a column slice of a wider fused output, as the decoder passes it
    a: torch.Tensor
    b: torch.Tensor
    token_slots: np.ndarray
    ranks: dict[int, int]

    def plan(self, device):
        return plan_tokens(self.token_slots, device)

    @property
    def max_rank(self) -> int:
        return max(self.ranks[s] for s in set(self.token_slots.tolist()) if s >= 0)


def make_lora_case(case, dtype: torch.dtype, device, seed: int = 0) -> LoRACase:
    name, tokens, n_in, n_out, slots, rank, ranks, pattern = case
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).to(device=device, dtype=dtype)

    a, b = rand(slots, rank, n_in), rand(slots, n_out, rank)
    for s, r in enumerate(ranks):  # padding past each adapter's rank is zero, as the slots keep it
        a[s, r:] = 0
        b[s, :, r:] = 0
    rng = np.random.default_rng(seed)
    if pattern == "grouped":
        token_slots = np.sort(rng.integers(-1, slots, tokens))
    else:
        token_slots = rng.integers(-1, slots, tokens)
    fused = rand(tokens, n_out + 40)
    return LoRACase(
        name, rand(tokens, n_in), fused[:, 20 : 20 + n_out], a, b, token_slots, dict(enumerate(ranks))
    )


def lora_by_token(case: LoRACase) -> torch.Tensor:
    """The definition, one token at a time in fp32: what every batched form must equal."""
    want = case.out.float().clone()
    for t, s in enumerate(case.token_slots.tolist()):
        if s >= 0:
            want[t] += (case.x[t].float() @ case.a[s].float().T) @ case.b[s].float().T
    return want
