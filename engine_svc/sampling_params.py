"""What a caller may ask of one request's sampling and stopping, validated before it is admitted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Sampling below this temperature is greedy (a zero temperature cannot divide logits).
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] | str | None = None  # matched on text, outside the engine core
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: the sampled token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Set by the engine from the model's generation config, not by callers.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Raise ``ValueError`` naming the field and its limit; change nothing."""
        _check_int(self.n, "n", lo=1)
        _check_float(self.temperature, "temperature", lo=0.0, hint=">= 0")
        _check_float(self.top_p, "top_p", hint="in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int(self.top_k, "top_k", lo=-1)
        _check_float(self.min_p, "min_p", hint="in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float(self.repetition_penalty, "repetition_penalty", hint="> 0")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(value, name, hint="in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int(self.seed, "seed", lo=-(2**63), hi=2**63 - 1)
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", lo=1)
        _check_int(self.min_tokens, "min_tokens", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for tid in self.stop_token_ids:
            _check_int(tid, "stop_token_ids", lo=0, hi=vocab_size - 1)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(value, name, lo=0, hi=max_logprobs)


def _check_int(value, name: str, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_float(value, name: str, lo: float | None = None, hint: str = "") -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or math.isinf(value)
    ):
        raise ValueError(f"{name} must be a finite number {hint}, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be {hint}, got {value}")
