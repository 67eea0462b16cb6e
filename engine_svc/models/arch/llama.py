"""Llama 2/3 (and SmolLM, and Mistral as llama.cpp converts it): the base declaration."""

from engine_svc.models.arch import Architecture, register

LLAMA = register(
    Architecture(name="LlamaForCausalLM", gguf="llama", gguf_permuted_qk=True, model_type="llama")
)
