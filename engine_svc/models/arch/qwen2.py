"""Qwen2 / Qwen2.5: Llama's layer with a bias on q, k and v."""

from engine_svc.models.arch import Architecture, register

QWEN2 = register(
    Architecture(
        name="Qwen2ForCausalLM",
        gguf="qwen2",
        qkv_bias=True,
        model_type="qwen2",
        tiny_config={"use_sliding_window": False},
    )
)
