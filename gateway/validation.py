"""Check a GenerateRequest field by field before anything is tokenized or sent to the engine.

Every problem found is reported at once as a google.rpc BadRequest field violation named after
the proto field, so a client can fix them all in one round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_svc.sampling_params import SamplingParams
from gateway.constraints import read_constraints
from gateway.errors import FieldViolation, invalid
from gateway.input_bounds import check_chat, check_text
from gateway.limits import Limits
from gateway.tool_request import Names, chat_messages
from llmserve_proto.llmserve.v1 import generation_pb2 as pb


@dataclass
class ValidatedRequest:
    prompt_kind: str  # "text", "token_ids" or "chat"
    text: str | None
    token_ids: list[int] | None
    chat: list[dict] | None
    add_generation_prompt: bool
    params: SamplingParams  # stop strings included; the engine ignores them
    return_token_ids: bool
    priority: int
    allow_special_tokens: bool = False  # parse special-token strings in `text` (unsafe; opt-in)

    @property
    def n(self) -> int:
        return self.params.n


def validate_generate(
    req: pb.GenerateRequest, vocab_size: int, max_model_len: int, limits: Limits
) -> ValidatedRequest:
    v: list[FieldViolation] = []

    def bad(field: str, description: str) -> None:
        v.append(FieldViolation(field, description))

    if len(req.request_id) > limits.max_request_id_chars:
        bad("request_id", f"at most {limits.max_request_id_chars} characters")
    elif any(not c.isprintable() for c in req.request_id):
        bad("request_id", "must be printable text")

    kind = req.WhichOneof("prompt")
    text = token_ids = chat = None
    if kind is None:
        bad("prompt", "one of text, token_ids or chat is required")
    elif kind == "text":
        text = req.text
        v.extend(check_text(text, "text", limits))
    elif kind == "token_ids":
        # The count first: a list of millions of ids is refused before it is copied.
        count, cap = len(req.token_ids.ids), limits.prompt_token_limit(max_model_len)
        if not count:
            bad("token_ids.ids", "must not be empty")
        elif count > cap:
            bad(
                "token_ids.ids",
                f"has {count} tokens; the limit is {cap} (max_model_len {max_model_len})",
            )
        else:
            token_ids = list(req.token_ids.ids)
            for i, t in enumerate(token_ids):
                if not 0 <= t < vocab_size:
                    bad(f"token_ids.ids[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")
                    break
    else:
        chat_violations = check_chat(req.chat.messages, "chat.messages", limits)
        v.extend(chat_violations)
        if not chat_violations:
            chat = chat_messages(req.chat.messages, Names(), bad)

    def fnum(name: str, default: float, ok, rule: str) -> float:
        if not req.HasField(name):
            return default
        value = getattr(req, name)
        if math.isnan(value) or math.isinf(value) or not ok(value):
            bad(name, f"must be {rule}, got {value}")
            return default
        return value

    temperature = fnum("temperature", 1.0, lambda x: x >= 0, "a finite number >= 0")
    top_p = fnum("top_p", 1.0, lambda x: 0 < x <= 1, "in (0, 1]")
    min_p = fnum("min_p", 0.0, lambda x: 0 <= x <= 1, "in [0, 1]")
    repetition_penalty = fnum("repetition_penalty", 1.0, lambda x: x > 0, "> 0")
    presence_penalty = fnum("presence_penalty", 0.0, lambda x: -2 <= x <= 2, "in [-2, 2]")
    frequency_penalty = fnum("frequency_penalty", 0.0, lambda x: -2 <= x <= 2, "in [-2, 2]")
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k < -1:
        bad("top_k", f"must be >= -1 (-1 and 0 are off), got {top_k}")
        top_k = 0
    if top_k > vocab_size:
        bad("top_k", f"must be <= the vocabulary size {vocab_size}, got {top_k}")
    n = req.n if req.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        bad("n", f"must be in [1, {limits.max_n}], got {n}")
        n = 1

    max_tokens = req.max_tokens if req.HasField("max_tokens") else limits.default_max_tokens
    cap = limits.max_tokens_limit(max_model_len)
    if not 1 <= max_tokens <= cap:
        bad(
            "max_tokens",
            f"must be in [1, {cap}] (the server's limit; the model's context is {max_model_len}), "
            f"got {max_tokens}",
        )
        max_tokens = 1
    min_tokens = req.min_tokens if req.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
        min_tokens = 0

    stop = list(req.stop)
    if len(stop) > limits.max_stop_strings:
        bad("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            bad(f"stop[{i}]", "must not be empty")
        elif len(s) > limits.max_stop_string_chars:
            bad(f"stop[{i}]", f"at most {limits.max_stop_string_chars} characters, got {len(s)}")
    stop_token_ids = list(req.stop_token_ids)
    if len(stop_token_ids) > limits.max_stop_token_ids:
        bad("stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(stop_token_ids)}")
    for i, t in enumerate(stop_token_ids):
        if not 0 <= t < vocab_size:
            bad(f"stop_token_ids[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")

    logprobs = req.logprobs if req.HasField("logprobs") else None
    prompt_logprobs = req.prompt_logprobs if req.HasField("prompt_logprobs") else None
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > limits.max_logprobs:
            bad(name, f"must be <= {limits.max_logprobs}, got {value}")
    constraints = read_constraints(req, vocab_size, bad)

    if v:
        raise invalid(v)
    params = SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=req.seed if req.HasField("seed") else None,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        speculative=req.speculative if req.HasField("speculative") else True,
        **constraints,
    )
    add_gen = (
        req.chat.add_generation_prompt
        if kind == "chat" and req.chat.HasField("add_generation_prompt")
        else True
    )
    return ValidatedRequest(
        prompt_kind=kind,
        text=text,
        token_ids=token_ids,
        chat=chat,
        add_generation_prompt=add_gen,
        params=params,
        return_token_ids=req.return_token_ids,
        priority=req.priority,
        allow_special_tokens=req.allow_special_tokens,
    )


def check_prompt_length(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, field: str, max_prompt_tokens: int = 0
) -> None:
    """After tokenizing: the prompt and the tokens asked for must fit the model's context."""
    limit = min(max_prompt_tokens, max_model_len - 1) if max_prompt_tokens > 0 else max_model_len - 1
    if num_prompt_tokens == 0:
        raise invalid([FieldViolation(field, "the prompt encodes to no tokens")])
    if num_prompt_tokens > limit:
        raise invalid(
            [
                FieldViolation(
                    field,
                    f"the prompt has {num_prompt_tokens} tokens; the limit is "
                    f"{limit} (max_model_len {max_model_len})",
                )
            ]
        )
    if num_prompt_tokens + max_tokens > max_model_len:
        raise invalid(
            [
                FieldViolation(
                    "max_tokens",
                    f"the prompt has {num_prompt_tokens} tokens and max_tokens "
                    f"is {max_tokens}: together more than the model's "
                    f"context of {max_model_len} tokens",
                )
            ]
        )


def check_fits_kv_pool(num_prompt_tokens: int, max_tokens: int, block_size: int, num_kv_blocks: int) -> None:
    """A request that could never fit the engine's whole KV cache is refused here, not queued forever
    (the engine would refuse it too; the gateway answers first so the engine never sees it)."""
    if not block_size or not num_kv_blocks:
        return
    needed = -(-(num_prompt_tokens + max_tokens) // block_size)
    if needed > num_kv_blocks:
        raise invalid(
            [
                FieldViolation(
                    "max_tokens" if num_prompt_tokens < num_kv_blocks * block_size else "prompt",
                    f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
                    f"{needed} KV blocks; the server's whole cache has {num_kv_blocks} blocks of "
                    f"{block_size} tokens",
                )
            ]
        )
