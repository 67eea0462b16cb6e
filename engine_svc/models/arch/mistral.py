"""Mistral: Llama's layer; its sliding window (when the config has one) is not served per layer, so
max_model_len stays inside it."""

from engine_svc.models.arch import Architecture, register

MISTRAL = register(Architecture(name="MistralForCausalLM", gguf="mistral", gguf_permuted_qk=True))
