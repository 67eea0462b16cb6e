"""A request and its sequences. One counter per sequence, ``num_computed_tokens``, chases
``len(token_ids)``: chunked prefill, prefix hits, decode and recompute all just move it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine_svc.outputs import TokenLogprob
from engine_svc.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival: int
    max_tokens: int  # params.max_tokens resolved against the context length
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: set once the n sequences exist
    generators: list[torch.Generator | None] | None = None  # per sequence index, when seeded
    aborted_indexes: set[int] = field(default_factory=set)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        # Read for every sequence on every step: fields computed once, not properties.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # add_request guarantees prompt + max_tokens <= max_model_len, so this is the only length bound.
        self.length_limit = self.num_prompt_tokens + self.max_tokens
        eos = () if self.params.ignore_eos else self.params.eos_token_ids
        self.stop_ids = frozenset(self.params.stop_token_ids) | frozenset(eos)
        self.min_stop_len = self.num_prompt_tokens + self.params.min_tokens  # no stop token before this


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int
    token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks of token_ids, lazily extended
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    admitted_before: bool = False
    finish_reason: str | None = None
    stop_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1
