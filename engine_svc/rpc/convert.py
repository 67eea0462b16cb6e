"""Between engine.v1 messages and the engine's own types (SamplingParams, RequestDelta)."""

from __future__ import annotations

import json

from engine_svc.outputs import RequestDelta, TokenLogprob
from engine_svc.sampling_params import SamplingParams
from engine_svc.sequence import FinishReason
from engine_svc.structured_outputs import StructuredOutputsParams
from llmserve_proto.engine.v1 import engine_pb2 as pb

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        n=p.n or 1,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        logit_bias=dict(p.logit_bias) or None,
        allowed_token_ids=list(p.allowed_token_ids) or None,
        bad_words_token_ids=[list(w.ids) for w in p.bad_words] or None,
        structured_outputs=_constraint_from_proto(p),
        speculative=p.speculative if p.HasField("speculative") else True,
        pooling=p.pooling or None,
        normalize=p.normalize if p.HasField("normalize") else True,
    )


def _constraint_from_proto(p) -> StructuredOutputsParams | None:
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=p.json_schema)
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(p.choice.choices))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=p.json_object)
    return StructuredOutputsParams(**{kind: getattr(p, kind)})


def _constraint_to_proto(so: StructuredOutputsParams, msg) -> None:
    """Either proto's ``constraint`` oneof (engine.v1 and llmserve.v1 name its fields alike)."""
    kind = so.kind()
    if kind == "json":
        msg.json_schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
    elif kind == "choice":
        msg.choice.choices.extend(so.choice)
    else:
        setattr(msg, kind, getattr(so, kind))


def sampling_params_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    """The gateway's side: every field is explicit, so the engine applies no defaults of its own."""
    msg = pb.SamplingParams(
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        min_tokens=sp.min_tokens,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
    )
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        if value is not None:
            setattr(msg, name, value)
    if sp.logit_bias:
        msg.logit_bias.update(sp.logit_bias)
    if sp.allowed_token_ids is not None:
        msg.allowed_token_ids.extend(sp.allowed_token_ids)
    for word in sp.bad_words_token_ids or ():
        msg.bad_words.add(ids=word)
    if sp.structured_outputs is not None:
        _constraint_to_proto(sp.structured_outputs, msg)
    if not sp.speculative:
        msg.speculative = False
    if sp.pooling is not None:
        msg.pooling = sp.pooling
        msg.normalize = sp.normalize
    return msg


def _logprob_to_proto(lp: TokenLogprob | None, out: pb.TokenLogprob) -> None:
    if lp is None:
        out.absent = True
        return
    out.token_id = lp.token_id
    out.logprob = lp.logprob
    out.rank = lp.rank
    for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=False):
        out.top.add(token_id=tid, logprob=value)


def delta_to_proto(d: RequestDelta, request_id: str, inline_ids: bool) -> pb.SequenceDelta:
    msg = pb.SequenceDelta(
        request_id=request_id,
        index=d.index,
        num_token_ids=len(d.new_token_ids),
        finish_reason=FINISH_TO_PROTO[d.finish_reason],
        num_prompt_tokens=d.num_prompt_tokens,
        num_cached_tokens=d.num_cached_tokens,
        request_finished=d.request_finished,
        error=d.error or "",
        num_draft_tokens=d.num_draft_tokens,
        num_accepted_draft_tokens=d.num_accepted_draft_tokens,
    )
    if inline_ids:
        msg.token_ids.extend(d.new_token_ids)
    if d.embedding is not None:
        msg.embedding = d.embedding
    if d.stop_token_id is not None:
        msg.stop_token_id = d.stop_token_id
    for lp in d.logprobs or ():
        _logprob_to_proto(lp, msg.logprobs.add())
    for lp in d.prompt_logprobs or ():
        _logprob_to_proto(lp, msg.prompt_logprobs.add())
    return msg
