"""LoRA as wrapped layers: each projection that adapters may target is wrapped, once, at load, so
that the model code has no LoRA in it. A wrapped projection computes the base GEMM and then adds
the step's LoRA deltas of each token's own adapter (``LoRABatch.apply``) in place.

Which adapters a step uses is planned by the runner (``LoRAManager.batch``) and set on the model's
``LoRAStep`` for the forward's duration; with no adapter in a step the wrappers only call through."""

from __future__ import annotations

from engine_svc.lora.batch import LoRABatch

# The decoder layer's projection attributes and the fused LoRA stack each one reads.
WRAPPED = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


class LoRAStep:
    """The step's LoRA mapping, shared by every wrapped projection of one model."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear:
    def __init__(self, base, layer: int, fused: str, step: LoRAStep):
        self.base, self.layer, self.fused, self.step = base, layer, fused, step

    def __call__(self, x):
        out = self.base(x)
        batch = self.step.batch
        if batch is not None:
            batch.apply(self.layer, self.fused, x, out)
        return out


def wrap_lora_layers(model) -> LoRAStep:
    """Wrap every adapter-capable projection of ``model`` (after its linears are prepared); the
    returned ``LoRAStep`` is where the runner puts each step's ``LoRABatch``."""
    step = LoRAStep()
    for layer in model.layers:
        for attr, fused in WRAPPED.items():
            base = getattr(layer, attr)
            if isinstance(base, LoRALinear):
                base = base.base
            setattr(layer, attr, LoRALinear(base, layer.index, fused, step))
    model.invalidate()  # the native layer loop does not run wrapped projections
    return step
