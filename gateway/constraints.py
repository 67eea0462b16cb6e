"""Structured-output constraints and logit controls of a GenerateRequest: read into SamplingParams
fields (whose ids and biases ``SamplingParams.violations`` checks), the spec's size bounded before
any work, the grammar's syntax checked off the event loop, and bad words tokenized by the tokenizer
workers. The engine compiles the grammar against its vocabulary; it never sees the words, only
their token ids."""

from __future__ import annotations

import asyncio

from engine_svc.sampling_params import SamplingParams
from engine_svc.structured_outputs import MAX_CHOICES, MAX_SPEC_BYTES, StructuredOutputsParams
from gateway.errors import FieldViolation, invalid
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

MAX_BAD_WORDS = 128
MAX_BAD_WORD_BYTES = 256


def read_constraints(req: pb.GenerateRequest, bad) -> dict:
    """The SamplingParams fields of the constraint oneof and the logit controls; the spec's and the bad
    words' sizes (bounds on the work that follows) are reported through ``bad(field, why)``."""
    out: dict = {}
    kind = req.WhichOneof("constraint")
    if kind is not None:
        if kind == "choice":
            choices = list(req.choice.choices)
            if not 1 <= len(choices) <= MAX_CHOICES:
                bad("choice", f"must hold 1 to {MAX_CHOICES} strings, got {len(choices)}")
            elif sum(len(c.encode()) for c in choices) > MAX_SPEC_BYTES:
                bad("choice", f"the choices are over {MAX_SPEC_BYTES} bytes together")
            out["structured_outputs"] = StructuredOutputsParams(choice=tuple(choices))
        elif kind == "json_object":
            if req.json_object:
                out["structured_outputs"] = StructuredOutputsParams(json_object=True)
        else:
            spec = getattr(req, kind)
            if not spec or len(spec.encode()) > MAX_SPEC_BYTES:
                bad(kind, f"must be 1 to {MAX_SPEC_BYTES} bytes, got {len(spec.encode())}")
            field = {"json_schema": "json"}.get(kind, kind)
            out["structured_outputs"] = StructuredOutputsParams(**{field: spec})
    # Ids and biases are checked with the other sampling fields (SamplingParams.violations).
    if req.logit_bias:
        out["logit_bias"] = dict(req.logit_bias)
    if req.allowed_token_ids:
        out["allowed_token_ids"] = list(req.allowed_token_ids)
    words = list(req.bad_words)
    if len(words) > MAX_BAD_WORDS:
        bad("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
    for i, w in enumerate(words[:MAX_BAD_WORDS]):
        if not w or len(w.encode()) > MAX_BAD_WORD_BYTES:
            bad(f"bad_words[{i}]", f"must be 1 to {MAX_BAD_WORD_BYTES} bytes")
    return out


async def complete_constraints(params: SamplingParams, bad_words: list[str], encode) -> None:
    """The work that may take time, off the event loop: the grammar's syntax (INVALID_ARGUMENT with
    the library's message), and the token sequences of the bad words (each as it would begin the
    text and as it would follow a space, as vLLM does)."""
    if params.structured_outputs is not None:
        try:
            await asyncio.to_thread(params.structured_outputs.to_grammar)
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            field = field.removeprefix("structured_outputs.").replace("json", "json_schema", 1)
            raise invalid([FieldViolation(field if why else "constraint", (why or str(e))[:400])]) from None
    if bad_words:
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word, " " + word.lstrip()):
                ids = await encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        params.bad_words_token_ids = sequences
