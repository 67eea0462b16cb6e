"""Check a GenerateRequest field by field before anything is tokenized or sent to the engine.

Every problem found is reported at once as a google.rpc BadRequest field violation named after
the proto field, so a client can fix them all in one round.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_svc.request_limits import RequestLimits, Violation, prompt_violations, token_id_violations
from engine_svc.sampling_params import SamplingParams
from gateway.constraints import read_constraints
from gateway.errors import FieldViolation, invalid
from gateway.input_bounds import check_chat, check_text
from gateway.limits import Limits
from gateway.tool_request import Names, chat_messages
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.code_stop import BLOCK, LINE, block_threshold


@dataclass
class ValidatedRequest:
    prompt_kind: str  # "text", "token_ids", "chat" or "infill"
    text: str | None
    token_ids: list[int] | None
    chat: list[dict] | None
    add_generation_prompt: bool
    params: SamplingParams  # stop strings included; the engine ignores them
    return_token_ids: bool
    priority: int
    allow_special_tokens: bool = False  # parse special-token strings in `text` (unsafe; opt-in)
    enable_thinking: bool | None = None  # the chat template's enable_thinking; None: not passed
    code_stop: tuple[str, int] | None = None  # a code completion's rule and threshold (stop_at)

    @property
    def n(self) -> int:
        return self.params.n


def validate_generate(
    req: pb.GenerateRequest,
    vocab_size: int,
    max_model_len: int,
    limits: Limits,
    eos_token_ids: tuple[int, ...] = (),
) -> ValidatedRequest:
    v: list[FieldViolation] = []

    def bad(field: str, description: str) -> None:
        v.append(FieldViolation(field, description))

    if len(req.request_id) > limits.max_request_id_chars:
        bad("request_id", f"at most {limits.max_request_id_chars} characters")
    elif any(not c.isprintable() for c in req.request_id):
        bad("request_id", "must be printable text")

    # The rules themselves are the engine's (engine_svc/request_limits.py), with this server's limits.
    rules = request_limits(vocab_size, max_model_len, limits, eos_token_ids=eos_token_ids)
    kind = req.WhichOneof("prompt")
    text = token_ids = chat = None
    if kind is None:
        bad("prompt", "one of text, token_ids, chat or infill is required")
    elif kind == "text":
        text = req.text
        v.extend(check_text(text, "text", limits))
    elif kind == "token_ids":
        # The count first: a list of millions of ids is refused before it is copied.
        count_violations = prompt_violations(len(req.token_ids.ids), 0, rules, "token_ids.ids")
        v.extend(_named(count_violations))
        if not count_violations:
            token_ids = list(req.token_ids.ids)
            ids_violations = token_id_violations(token_ids, "token_ids.ids", vocab_size, first_only=True)
            v.extend(_named(ids_violations))
    elif kind == "infill":
        pass  # its pieces are checked where the door's names are known (gateway/infill.py)
    else:
        chat_violations = check_chat(req.chat.messages, "chat.messages", limits)
        v.extend(chat_violations)
        if not chat_violations:
            chat = chat_messages(req.chat.messages, Names(), bad)

    constraint_violations: list[FieldViolation] = []  # reported after the sampling fields'
    constraints = read_constraints(req, lambda f, why: constraint_violations.append(FieldViolation(f, why)))
    params = SamplingParams(
        n=req.n if req.HasField("n") else 1,
        temperature=req.temperature if req.HasField("temperature") else 1.0,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        top_k=req.top_k if req.HasField("top_k") else 0,
        min_p=req.min_p if req.HasField("min_p") else 0.0,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        presence_penalty=req.presence_penalty if req.HasField("presence_penalty") else 0.0,
        frequency_penalty=req.frequency_penalty if req.HasField("frequency_penalty") else 0.0,
        seed=req.seed if req.HasField("seed") else None,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else limits.default_max_tokens,
        min_tokens=req.min_tokens if req.HasField("min_tokens") else 0,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        speculative=req.speculative if req.HasField("speculative") else True,
        **constraints,
    )
    v.extend(_named(params.violations(rules)))
    v.extend(constraint_violations)
    code_stop = _code_stop(req, bad)
    if len(req.supersede_key) > MAX_SUPERSEDE_KEY_CHARS:
        bad("supersede_key", f"at most {MAX_SUPERSEDE_KEY_CHARS} characters, got {len(req.supersede_key)}")
    elif any(not c.isprintable() for c in req.supersede_key):
        bad("supersede_key", "must be printable text")
    if v:
        raise invalid(v)
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
        enable_thinking=(
            req.chat.enable_thinking if kind == "chat" and req.chat.HasField("enable_thinking") else None
        ),
        code_stop=code_stop,
    )


MAX_SUPERSEDE_KEY_CHARS = 256
MAX_STOP_INDENT = 1024
_STOP_AT = {pb.STOP_AT_LINE: LINE, pb.STOP_AT_BLOCK: BLOCK}


def _code_stop(req: pb.GenerateRequest, bad) -> tuple[str, int] | None:
    """stop_at's rule and, for a block, the indentation below which a line leaves it: stop_indent,
    else the cursor line's (the last line of the text before the cursor)."""
    if req.stop_at == pb.STOP_AT_UNSPECIFIED:
        if req.HasField("stop_indent"):
            bad("stop_indent", "needs stop_at: block")
        return None
    rule = _STOP_AT.get(req.stop_at)
    if rule is None:
        bad("stop_at", f"must be STOP_AT_LINE or STOP_AT_BLOCK, got {req.stop_at}")
        return None
    if req.HasField("stop_indent"):
        if rule != BLOCK:
            bad("stop_indent", "needs stop_at: block")
        elif not 1 <= req.stop_indent <= MAX_STOP_INDENT:
            bad("stop_indent", f"must be in [1, {MAX_STOP_INDENT}], got {req.stop_indent}")
    kind = req.WhichOneof("prompt")
    before = req.infill.prefix + req.infill.middle if kind == "infill" else req.text if kind == "text" else ""
    indent = req.stop_indent if req.HasField("stop_indent") else None
    return rule, block_threshold(before[-4096:], indent)  # the last line's indentation


def request_limits(
    vocab_size: int,
    max_model_len: int,
    limits: Limits,
    block_size: int = 0,
    num_kv_blocks: int = 0,
    eos_token_ids: tuple[int, ...] = (),
) -> RequestLimits:
    """The shared rules' limits as this server sets them."""
    return RequestLimits(
        vocab_size,
        max_model_len,
        max_logprobs=limits.max_logprobs,
        max_n=limits.max_n,
        max_tokens=limits.max_tokens_limit(max_model_len),
        max_prompt_tokens=limits.max_prompt_tokens,
        max_stop_strings=limits.max_stop_strings,
        max_stop_string_chars=limits.max_stop_string_chars,
        max_stop_token_ids=limits.max_stop_token_ids,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        eos_token_ids=tuple(eos_token_ids),
    )


def check_prompt_length(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    field: str,
    max_prompt_tokens: int = 0,
    block_size: int = 0,
    num_kv_blocks: int = 0,
) -> None:
    """After tokenizing: the prompt and the tokens asked for must fit the model's context, and the
    engine's whole KV cache (a request that never could would be queued forever)."""
    rules = RequestLimits(
        0,
        max_model_len,
        max_prompt_tokens=max_prompt_tokens,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
    )
    v = prompt_violations(num_prompt_tokens, max_tokens, rules, field)
    if v:
        raise invalid(_named(v))


def _named(violations: list[Violation]) -> list[FieldViolation]:
    return [FieldViolation(x.field, x.message) for x in violations]
