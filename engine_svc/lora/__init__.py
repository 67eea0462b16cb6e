"""Multi-LoRA serving: PEFT adapters read into host memory, a fixed number of device slots, and a
batched forward where each token goes through its own adapter (or none)."""

from engine_svc.lora.request import LoRARequest

__all__ = ["LoRARequest"]
