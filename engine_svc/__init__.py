"""The engine: paged KV cache, continuous batching, prefix caching; token ids in, token ids out."""

from engine_svc.config import EngineConfig, ModelInfo
from engine_svc.lora.request import LoRARequest
from engine_svc.sampling_params import SamplingParams
from engine_svc.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "LoRARequest",
    "ModelInfo",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name):
    # LLM and LLMEngine pull in torch and the model code: import them only when asked for.
    if name == "LLMEngine":
        from engine_svc.engine import LLMEngine

        return LLMEngine
    if name == "LLM":
        from engine_svc.llm import LLM

        return LLM
    raise AttributeError(name)
