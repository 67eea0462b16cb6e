"""Where each LoRA target sits in the model: its input and output widths, and which slice of the
decoder's fused projection (``qkv_proj``, ``gate_up_proj``) its delta is added to."""

from __future__ import annotations

from dataclasses import dataclass

from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The decoder's fused projections, and the PEFT modules whose outputs are slices of them.
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class Target:
    module: str
    fused: str  # key of FUSED
    in_features: int
    out_features: int
    offset: int  # first column of this module's output within the fused output


def targets(spec: ModelSpec, shard: Shard | None = None) -> dict[str, Target]:
    """Per PEFT module name, its geometry on this rank (all of it when unsharded)."""
    shard = shard or Shard()
    h, d = spec.hidden_size, spec.head_dim
    q, kv, inter = shard.heads(spec) * d, shard.kv_heads(spec) * d, shard.intermediate(spec)
    return {
        "q_proj": Target("q_proj", "qkv", h, q, 0),
        "k_proj": Target("k_proj", "qkv", h, kv, q),
        "v_proj": Target("v_proj", "qkv", h, kv, q + kv),
        "o_proj": Target("o_proj", "o", q, h, 0),
        "gate_proj": Target("gate_proj", "gate_up", h, inter, 0),
        "up_proj": Target("up_proj", "gate_up", h, inter, inter),
        "down_proj": Target("down_proj", "down", inter, h, 0),
    }


def shard_pair(module: str, a, b, spec: ModelSpec, shard: Shard) -> tuple:
    """This rank's part of one module's (A [r, in], B [out, r]), split like its base layer:
    column-parallel projections (q/k/v, gate/up) keep A whole and take their output rows of B;
    row-parallel ones (o, down) take their input columns of A and keep B whole (the partial
    deltas are summed by the layer's all-reduce, as its base output is)."""
    if shard.size == 1:
        return a, b
    d = spec.head_dim
    if module == "q_proj":
        n = shard.heads(spec) * d
        return a, b[shard.rank * n : (shard.rank + 1) * n]
    if module in ("k_proj", "v_proj"):
        start, n = shard.kv_head_start(spec) * d, shard.kv_heads(spec) * d
        return a, b[start : start + n]
    if module in ("gate_proj", "up_proj"):
        n = shard.intermediate(spec)
        return a, b[shard.rank * n : (shard.rank + 1) * n]
    if module == "o_proj":
        n = shard.heads(spec) * d
        return a[:, shard.rank * n : (shard.rank + 1) * n], b
    n = shard.intermediate(spec)  # down_proj
    return a[:, shard.rank * n : (shard.rank + 1) * n], b
