"""What a caller may ask of one request's sampling and stopping, validated before it is admitted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_svc.structured_outputs import StructuredOutputsParams

# Sampling below this temperature is greedy (a zero temperature cannot divide logits).
GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_LOGIT_CONTROL_IDS = 4096  # entries in logit_bias, allowed_token_ids, or bad-word tokens, each


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
    # Logit controls, applied before sampling (and before logprobs are reported).
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Token sequences never to complete: the last token of each is banned whenever the output ends
    # with the ones before it (a one-token sequence: always). The text side tokenizes ``bad_words``.
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # False: this request never drafts (speculative decoding); True: as the engine is configured.
    # The tokens are the same either way, only the speed differs.
    speculative: bool = True
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
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be True or False, got {self.speculative!r}")
        self._validate_logit_controls(vocab_size)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.kind()

    def _validate_logit_controls(self, vocab_size: int) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_CONTROL_IDS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_CONTROL_IDS} token ids")
            for tid, bias in self.logit_bias.items():
                _check_int(tid, "logit_bias token id", lo=0, hi=vocab_size - 1)
                _check_float(bias, f"logit_bias[{tid}]", hint=f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
                if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(
                        f"logit_bias[{tid}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or len(ids) > MAX_LOGIT_CONTROL_IDS:
                raise ValueError(f"allowed_token_ids must hold 1 to {MAX_LOGIT_CONTROL_IDS} token ids")
            for tid in ids:
                _check_int(tid, "allowed_token_ids", lo=0, hi=vocab_size - 1)
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if sum(len(w) for w in words) > MAX_LOGIT_CONTROL_IDS:
                raise ValueError(f"bad words may hold at most {MAX_LOGIT_CONTROL_IDS} tokens in all")
            for word in words:
                if not word:
                    raise ValueError("a bad word must be at least one token")
                for tid in word:
                    _check_int(tid, "bad_words token id", lo=0, hi=vocab_size - 1)

    @property
    def has_logit_controls(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)


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
