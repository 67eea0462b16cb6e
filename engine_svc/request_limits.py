"""The one statement of what a request may ask: field-named violations, each rule written once.

``SamplingParams.violations`` checks the sampling and stopping fields; ``prompt_violations`` checks
a prompt against the model and the server (its ids in the vocabulary, its length against
max_model_len, prompt + max_tokens against the context, and the whole request against the KV pool).
Every door runs these same functions: the gateway to answer early (gRPC INVALID_ARGUMENT, HTTP 400,
one violation per field), the engine to refuse what reached it anyway (``InvalidRequest``, a
``ValueError`` whose text is the same "field message" sentences). Each violation's ``field`` is the
name the client sent: the gateway's proto names equal ``SamplingParams``' for every shared field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    field: str  # "top_p", "stop[2]", "logit_bias[5]", ...
    message: str  # what the value must be, and what it was: "must be in (0, 1], got 1.5"

    def __str__(self) -> str:
        return f"{self.field} {self.message}"


class InvalidRequest(ValueError):
    """A request refused before it is queued; ``violations`` names every field at fault."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        super().__init__("; ".join(map(str, self.violations)))


@dataclass(frozen=True)
class RequestLimits:
    """What the model and the server allow. ``None``: no limit beyond the model's own."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    max_n: int | None = None
    max_tokens: int | None = None  # the server's cap on max_tokens (below the context)
    max_prompt_tokens: int = 0  # 0: the context minus one
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None
    max_stop_token_ids: int | None = None
    block_size: int = 0  # with num_kv_blocks: the whole KV pool a request must fit (0: unchecked)
    num_kv_blocks: int = 0
    # Pages a request of n tokens holds (KV cache groups: engine_svc/kv_groups.py); None: one per block.
    kv_pages: Callable[[int], int] | None = None
    # The model's end-of-sequence ids (banned with the stop ids until min_tokens): a request whose
    # allowed_token_ids are all among them could never start. Empty: the check uses stop ids alone.
    eos_token_ids: tuple[int, ...] = ()

    @property
    def prompt_token_limit(self) -> int:
        cap = self.max_model_len - 1  # the prompt plus at least one generated token must fit
        return min(self.max_prompt_tokens, cap) if self.max_prompt_tokens > 0 else cap


def raise_if_any(violations: list[Violation]) -> None:
    if violations:
        raise InvalidRequest(violations)


def token_id_violations(ids, field: str, vocab_size: int, first_only: bool = False) -> list[Violation]:
    """``field[i]`` for each id outside [0, vocab_size) (the first only, for a prompt's ids)."""
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            out.append(Violation(f"{field}[{i}]", f"is {t!r}, outside the vocabulary [0, {vocab_size})"))
            if first_only:
                break
    return out


def prompt_violations(
    prompt_len: int, max_tokens: int | None, limits: RequestLimits, field: str
) -> list[Violation]:
    """A prompt of ``prompt_len`` tokens (``field``: how the client gave it) and ``max_tokens`` new
    ones (None: the rest of the context) against the context and the KV pool."""
    if prompt_len == 0:
        return [Violation(field, "must not be empty (the prompt has no tokens)")]
    limit, ctx = limits.prompt_token_limit, limits.max_model_len
    if prompt_len > limit:
        return [
            Violation(
                field,
                f"has {prompt_len} tokens; the limit is {limit} (max_model_len is {ctx}: the prompt "
                "plus at least one generated token must fit)",
            )
        ]
    total = ctx if max_tokens is None else prompt_len + max_tokens
    if total > ctx:
        return [
            Violation(
                "max_tokens",
                f"is {max_tokens}: with the prompt's {prompt_len} tokens that exceeds max_model_len ({ctx})",
            )
        ]
    bs, blocks = limits.block_size, limits.num_kv_blocks
    pages = limits.kv_pages
    if bs and blocks and (-(-total // bs) if pages is None else pages(total)) > blocks:
        # A request that could never fit the whole KV cache would be queued forever.
        return [
            Violation(
                "max_tokens" if prompt_len < blocks * bs else field,
                f"with the prompt ({prompt_len} tokens) needs "
                f"{-(-total // bs) if pages is None else pages(total)} KV blocks; the whole "
                f"cache has {blocks} blocks of {bs} tokens",
            )
        ]
    return []
