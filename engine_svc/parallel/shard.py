"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

Attention heads and MLP columns are split across ranks (column-parallel in, row-parallel out);
the vocabulary is split for the embedding and the LM head. With fewer KV heads than ranks, each
KV head is replicated on the ranks whose query heads use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_svc.models.spec import ModelSpec


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    def check(self, spec: ModelSpec) -> None:
        n = self.size
        problems = []
        if spec.num_heads % n:
            problems.append(f"num_attention_heads ({spec.num_heads})")
        if spec.num_kv_heads % n and n % spec.num_kv_heads:
            problems.append(f"num_key_value_heads ({spec.num_kv_heads}, nor a divisor of it)")
        if spec.intermediate_size % n:
            problems.append(f"intermediate_size ({spec.intermediate_size})")
        if spec.vocab_size % n:
            problems.append(f"vocab_size ({spec.vocab_size})")
        if problems:
            raise ValueError(f"tensor_parallel_size {n} must divide {', '.join(problems)}")

    # --- local sizes --------------------------------------------------------------------------
    def heads(self, spec: ModelSpec) -> int:
        return spec.num_heads // self.size

    def kv_heads(self, spec: ModelSpec) -> int:
        return max(1, spec.num_kv_heads // self.size)

    def kv_head_start(self, spec: ModelSpec) -> int:
        if spec.num_kv_heads >= self.size:
            return self.rank * self.kv_heads(spec)
        return self.rank * spec.num_kv_heads // self.size  # replicated: the head our query heads read

    def intermediate(self, spec: ModelSpec) -> int:
        return spec.intermediate_size // self.size

    def vocab_range(self, spec: ModelSpec) -> tuple[int, int]:
        part = spec.vocab_size // self.size
        return self.rank * part, (self.rank + 1) * part

    # --- collectives --------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
