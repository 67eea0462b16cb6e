"""``speculative_config``, vLLM-style: {"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}, or {"method": "draft_model", "model": DIR,
"num_speculative_tokens": 4}. ``num_speculative_tokens`` is also the server's cap: no request drafts
more per step."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: a smaller model directory with the target's vocabulary
    # Above this many decoding sequences a step is compute-bound: verifying drafts costs more than
    # the steps it saves, so nobody speculates (benchmarks/speculative.py measures where).
    max_batch: int = 8
    # A sequence whose drafts are accepted less often than this (after ``min_drafted``) stops
    # drafting: its verification rows would be wasted work.
    min_acceptance: float = 0.25
    min_drafted: int = 24
    # Measure, per batch size, seconds per emitted token with drafts and without, and draft only
    # where it is cheaper (spec_decode/governor.py). Off: draft whenever a proposer has something.
    adaptive: bool = True

    @classmethod
    def parse(cls, value: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict such as {'method': 'ngram', 'num_speculative_tokens': 4}"
            )
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config: 'model' (a draft model directory) goes with method 'draft_model', "
                f"and only with it; got method {self.method!r} and model {self.model!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config: model must be a directory path, got {self.model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            k = self.num_speculative_tokens
            raise ValueError(f"speculative_config: num_speculative_tokens must be in [1, 16], got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.max_batch < 1:
            raise ValueError(f"speculative_config: max_batch must be >= 1, got {self.max_batch}")
