"""Qwen3: Llama's layer with per-head RMSNorm on q and k (before rotary)."""

from engine_svc.models.arch import Architecture, register

QWEN3 = register(Architecture(name="Qwen3ForCausalLM", gguf="qwen3", qk_norm=True))
