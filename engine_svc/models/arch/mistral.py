"""Mistral: Llama's layer; its sliding window (when the config has one) is not served per layer, so
max_model_len stays inside it."""

from engine_svc.models.arch import Architecture, register

MISTRAL = register(
    Architecture(
        name="MistralForCausalLM",
        gguf="mistral",
        gguf_converted="llama",  # llama.cpp's converter writes Mistral as llama (the same decoder)
        gguf_permuted_qk=True,
        model_type="mistral",
        tiny_config={"sliding_window": None},
    )
)
