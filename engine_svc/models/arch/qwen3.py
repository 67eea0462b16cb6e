"""Qwen3: Llama's layer with per-head RMSNorm on q and k (before rotary)."""

from engine_svc.models.arch import Architecture, register

QWEN3 = register(
    Architecture(
        name="Qwen3ForCausalLM",
        gguf="qwen3",
        qk_norm=True,
        model_type="qwen3",
        tiny_config={"head_dim": None},  # Qwen3 carries head_dim explicitly (its default 128)
    )
)
