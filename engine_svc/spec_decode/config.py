"""``speculative_config``, vLLM-style: {"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Above this many decoding sequences a step is compute-bound: verifying drafts costs more than
    # the steps it saves, so nobody speculates (benchmarks/speculative.py measures where).
    max_batch: int = 8
    # A sequence whose drafts are accepted less often than this (after ``min_drafted``) stops
    # drafting: its verification rows would be wasted work.
    min_acceptance: float = 0.25
    min_drafted: int = 24

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
        if self.method == "draft_model":
            raise ValueError("speculative_config: method 'draft_model' is not available yet; use 'ngram'")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
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
