"""Token-only serving (``--skip-tokenizer-init``): a model directory without a tokenizer, for
sidecars that tokenize themselves. Prompts are token ids, outputs are token ids; everything that
needs the tokenizer (text and chat prompts, stop strings, bad words, structured-output grammars,
Tokenize and Detokenize) is refused before any work, naming the field and the reason."""

from __future__ import annotations

from gateway.errors import FieldViolation, invalid
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

WHY = "this server runs without a tokenizer (--skip-tokenizer-init)"


def check_generate(req: pb.GenerateRequest) -> None:
    """Refuse whatever in ``req`` needs text; every such field at once."""
    bad: list[FieldViolation] = []
    kind = req.WhichOneof("prompt")
    if kind == "text":
        bad.append(FieldViolation("text", f"{WHY}: send the prompt as token_ids"))
    elif kind == "chat":
        bad.append(FieldViolation("chat", f"{WHY}: render the chat yourself and send token_ids"))
    elif kind == "infill":
        bad.append(FieldViolation("infill", f"{WHY}: write the fill-in-the-middle prompt and send token_ids"))
    if req.stop:
        bad.append(FieldViolation("stop", f"{WHY}: stop strings need text; use stop_token_ids"))
    if req.stop_at != pb.STOP_AT_UNSPECIFIED:
        bad.append(FieldViolation("stop_at", f"{WHY}: the line and block rules read the text"))
    if req.bad_words:
        bad.append(FieldViolation("bad_words", f"{WHY}: bad words need tokenizing; use logit_bias"))
    constraint = req.WhichOneof("constraint")
    if constraint is not None:
        bad.append(FieldViolation(constraint, f"{WHY}: a grammar is compiled against the tokenizer"))
    if bad:
        raise invalid(bad)


def refuse_text_call(field: str, what: str) -> None:
    """Tokenize and Detokenize: there is nothing to do them with."""
    raise invalid([FieldViolation(field, f"{WHY}: {what} is not available")])
