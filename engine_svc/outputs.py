"""What the engine emits: per-step deltas (for the server) and whole results (for the offline API)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's logprob and rank, and the top-N alternatives (ids and logprobs)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)  # one per running sequence per step: slots make it cheaper to build
class RequestDelta:
    """What one engine step produced for one sequence of one request.

    ``index`` is the sequence (0..n-1). ``finish_reason`` is None while it runs, else a
    ``FinishReason`` ("stop": EOS or a stop token, ``stop_token_id`` says which; "length"; "abort").
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first delta only
    request_finished: bool = False  # the request's last delta: every one of its n outputs has ended
    error: str | None = None  # why a request ended early: its grammar did not compile, or hit a dead end
    # Speculative decoding, this sequence's totals so far: drafts verified, and drafts accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # An embedding request's vector (float32, little-endian), on its last delta.
    embedding: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ToolCallOutput:
    """A call ``LLM.chat`` read out of a reply (OpenAI's shape, flattened)."""

    id: str
    name: str
    arguments: str  # the arguments object as JSON text
    type: str = "function"


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this output
    num_accepted_draft_tokens: int = 0  # ... and accepted by the target model
    # LLM.chat with a tool-call parser / a reasoning parser: what was taken out of ``text``.
    tool_calls: list[ToolCallOutput] | None = None
    reasoning_content: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def num_draft_tokens(self) -> int:
        return sum(o.num_draft_tokens for o in self.outputs)

    @property
    def num_accepted_draft_tokens(self) -> int:
        return sum(o.num_accepted_draft_tokens for o in self.outputs)
