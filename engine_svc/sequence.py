"""A request and its sequences. One counter per sequence, ``num_computed_tokens``, chases
``len(token_ids)``: chunked prefill, prefix hits, decode and recompute all just move it.

A request with ``n > 1`` runs one sequence (index 0) through its prompt; at the prompt's end it
samples ``n`` first tokens and forks the other sequences, which share its blocks by reference
(copy-on-write). Which of its ``n`` outputs are still owed is held here, in ``Request.ended``, and
nowhere else: the engine, its server and the gateway ask, they do not keep copies."""

from __future__ import annotations

import enum
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from engine_svc.outputs import TokenLogprob
from engine_svc.sampling_params import SamplingParams

_seq_ids = itertools.count()
SEED_MASK = (1 << 64) - 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id (``stop_token_id`` says which)
    LENGTH = "length"  # max_tokens, or the context
    ABORT = "abort"  # the caller dropped it


def noise_key(seed: int, index: int, position: int) -> tuple[int, int]:
    """What a seeded row's noise is drawn from: (seed + index, all 64 bits; the position of the token
    being sampled). Noise is a pure function of these, not a stream: a token's draw is the same
    whatever was sampled, recomputed, speculated or rejected before it (torch's CPU generator would
    also keep only 32 bits of the seed, so 5 and 2**32 + 5 would draw alike)."""
    return ((seed + index) & SEED_MASK, position)


def draw_noise(key: tuple[int, int], size: int) -> np.ndarray:
    """Exp(1) noise for one row (the exponential race: argmax(p / E) samples from p)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))
    return rng.standard_exponential(size, dtype=np.float32)


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
    ended: set[int] = field(default_factory=set)  # indexes finished or aborted: owed no more output
    paused: bool = False  # takes no steps (a client that stopped reading); its blocks may be preempted
    # Prompt logprobs by position (entry 0 is always None): filled as chunks compute them, each
    # position once, whatever chunking and recompute do; sent whole with the request's first delta.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    grammar: Future | None = None  # of the first sequence's matcher, compiled off the loop
    lora: object = None  # engine_svc.lora.adapter.LoRAAdapter it runs under; None: the base model
    client: str = ""  # who sent it (the gateway's session and the caller's connection): fair share of a step

    def __post_init__(self) -> None:
        # Read for every sequence on every step: fields computed once, not properties.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # add_request guarantees prompt + max_tokens <= max_model_len, so this is the only length bound.
        self.length_limit = self.num_prompt_tokens + self.max_tokens
        eos = () if self.params.ignore_eos else self.params.eos_token_ids
        self.stop_ids = frozenset(self.params.stop_token_ids) | frozenset(eos)
        self.min_stop_len = self.num_prompt_tokens + self.params.min_tokens  # no stop token before this
        p = self.params
        # Drafts are verified row by row with the options that do not depend on earlier outputs;
        # those that do (penalties, bad words, min_tokens) never speculate. A grammar's state does
        # depend on them, but its matcher gives each draft position its mask (advanced through the
        # drafts before it, then rolled back; logits_processors.grammar.fill_grammar_bitmask).
        self.can_speculate = p.speculative and not (
            p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or p.bad_words_token_ids
            or p.min_tokens
        )
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        """Every one of the n outputs has ended."""
        return len(self.ended) == self.params.n

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.done()

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def record_prompt_logprobs(self, first: int, entries: list[TokenLogprob]) -> None:
        """``entries[i]`` is the logprob of prompt token ``first + 1 + i``. A position computed again
        (a recompute after preemption) keeps its first entry: nothing is added twice."""
        plp = self.prompt_logprobs
        for i, entry in enumerate(entries, start=first + 1):
            if plp[i] is None:
                plp[i] = entry


@dataclass(eq=False, slots=True)  # slots: no attribute that is not declared here
class Sequence:
    request: Request
    index: int
    token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    # Of the full blocks of token_ids, lazily extended: a pure function of the tokens. The blocks
    # themselves belong to the KV cache manager (``KVCacheManager.block_table``).
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    last_step: int = 0  # the scheduler's step count when it last computed this sequence
    admitted_before: bool = False
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    matcher: object = None  # llguidance.LLMatcher of a structured-output request: its grammar state
    # The proposer's drafts of the tokens after token_ids (from the step that sampled its last token):
    # the next step may verify them. Replaced by every step that samples for it; never mutated.
    spec_token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    # Its last verification accepted every draft (true until it has one): it may draft again after
    # its next step whatever the governor's average says (a run of copied text, an editor's last
    # completion typed again), where such a step pays (``SpeculationGovernor.full_drafts_pay``)
    draft_streak: bool = True
    # A proposer's own state (an n-gram index, how far a draft model's cache holds the sequence)
    # is not here: the runner's proposer keeps it by seq_id (spec_decode/proposer.py).

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
