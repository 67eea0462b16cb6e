"""A fill-in-the-middle request's prompt, built by the gateway in the served model's FIM format.

Every door (gRPC ``Infill``, ``/infill``, ``suffix`` on ``/v1/completions`` and on Ollama's
``/api/generate``) becomes ``GenerateRequest.infill``; this module checks its pieces (each
violation named as the door spells the field), encodes them in the tokenizer workers as plain text,
and splices in the model's control tokens (tokenizer_svc/fim.py). The result is a token-id prompt
like any other: the engine sees nothing new, so the same ids through ``LLM.generate`` give the same
tokens.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.errors import FieldViolation, invalid
from gateway.input_bounds import check_text
from gateway.limits import Limits
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.fim import FimInput, FimSpec, FimUnavailable, Text, assemble, find_fim, layout

log = logging.getLogger("gateway.infill")

MAX_INFILL_FILES = 256
ORDERS = {pb.FIM_ORDER_UNSPECIFIED: "", pb.FIM_ORDER_PSM: "psm", pb.FIM_ORDER_SPM: "spm"}


@dataclass(frozen=True)
class InfillNames:
    """How a door names the pieces in its violations (default: the proto's)."""

    whole: str = "infill"
    prefix: str = "infill.prefix"
    suffix: str = "infill.suffix"
    files: str = "infill.files"
    path: str = "infill.path"
    repo_name: str = "infill.repo_name"
    middle: str = "infill.middle"
    order: str = "infill.order"


PROTO_NAMES = InfillNames()


def model_fim(model_dir: str | Path, tokenizer, order: str = "") -> FimSpec | FimUnavailable:
    """The served model's FIM format, or why it has none (kept, and said to each FIM request).
    ``order`` (--fim-order): the layout of a request that names none, where the format can take it
    (else the family's own)."""
    from engine_svc.models.model_path import resolve_model_path
    from tokenizer_svc.fim import read_gguf_fim_ids

    gguf_ids: dict[str, int] = {}
    try:
        where = resolve_model_path(Path(model_dir))
        if where.is_gguf:
            gguf_ids = read_gguf_fim_ids(where.gguf)
    except Exception as e:  # the metadata is a hint: the vocabulary still decides
        log.warning("GGUF FIM metadata not read: %s", e)
    try:
        spec = find_fim(
            tokenizer.token_to_id, tokenizer.bos_token_id, gguf_ids, tokenizer.convert_ids_to_tokens
        )
    except FimUnavailable as e:
        return e
    if order and order not in spec.orders:
        log.warning("--fim-order %s: the %s format takes only %s", order, spec.family.name, spec.family.order)
        order = ""
    spec = replace(spec, order=order)
    log.info(
        "fill-in-the-middle: %s format (from the %s), %s order",
        spec.family.name,
        spec.source,
        spec.resolve_order(),
    )
    return spec


def check_infill(infill: pb.Infill, limits: Limits, names: InfillNames = PROTO_NAMES) -> FimInput:
    """The pieces' sizes and shapes; every violation at once, named as the door names them."""
    v: list[FieldViolation] = []
    total = len(infill.prefix) + len(infill.suffix) + len(infill.middle)
    total += sum(len(f.path) + len(f.text) for f in infill.files) + len(infill.path) + len(infill.repo_name)
    if total > limits.max_prompt_chars:
        v.append(
            FieldViolation(
                names.whole,
                f"prefix, suffix and files have {total} characters; the limit is "
                f"max_prompt_chars={limits.max_prompt_chars}",
            )
        )
    if not infill.prefix and not infill.suffix and not infill.middle:
        v.append(FieldViolation(names.prefix, "a prefix or a suffix is required (both are empty)"))
    if infill.order not in ORDERS:
        v.append(FieldViolation(names.order, f"unknown order {infill.order}; psm or spm"))
    if len(infill.files) > MAX_INFILL_FILES:
        v.append(
            FieldViolation(names.files, f"has {len(infill.files)} files; the limit is {MAX_INFILL_FILES}")
        )
    for field, text in ((names.path, infill.path), (names.repo_name, infill.repo_name)):
        if "\n" in text:
            v.append(FieldViolation(field, "must be one line"))
    for i, f in enumerate(infill.files[:MAX_INFILL_FILES]):
        if "\n" in f.path:
            v.append(FieldViolation(f"{names.files}[{i}].filename", "must be one line"))
    for field, text in ((names.prefix, infill.prefix), (names.suffix, infill.suffix)):
        if text:  # empty is allowed here; the size is checked as check_text does for a prompt
            v.extend(x for x in check_text(text, field, limits) if "must not be empty" not in x.description)
    if v:
        raise invalid(v)
    return FimInput(
        prefix=infill.prefix,
        suffix=infill.suffix,
        files=[(f.path, f.text) for f in infill.files],
        path=infill.path,
        repo_name=infill.repo_name,
        middle=infill.middle,
        order=ORDERS.get(infill.order, ""),
    )


def spec_or_refuse(fim, names: InfillNames) -> FimSpec:
    if isinstance(fim, FimSpec):
        return fim
    why = str(fim) if fim is not None else "the server runs without a tokenizer (--skip-tokenizer-init)"
    raise invalid([FieldViolation(names.whole, why)])


def fim_pieces(spec: FimSpec, inp: FimInput, names: InfillNames) -> list:
    try:
        spec.resolve_order(inp.order)
    except FimUnavailable as e:
        raise invalid([FieldViolation(names.order, str(e))]) from None
    try:
        return layout(spec, inp)
    except FimUnavailable as e:
        raise invalid([FieldViolation(names.files, str(e))]) from None


async def infill_ids(spec: FimSpec, pieces: list, encode, room: int | None, step: int) -> list[int]:
    """The prompt's ids: every text run encoded in the workers (at once), then spliced and cut."""
    texts = [(i, p.text) for i, p in enumerate(pieces) if isinstance(p, Text)]
    texts += [(-1 - i, p.head) for i, p in enumerate(pieces) if isinstance(p, Text) and p.head]
    encoded = await asyncio.gather(
        *(encode(t, add_special_tokens=False, parse_special_tokens=False) for _, t in texts)
    )
    runs = dict(zip((i for i, _ in texts), encoded, strict=True))
    heads = {-1 - i: e for i, e in runs.items() if i < 0}  # a run's head (StarCoder2's path line)
    ids, cut = assemble(pieces, {i: e for i, e in runs.items() if i >= 0}, room, step, heads)
    if cut.prefix_tokens or cut.suffix_tokens or cut.files:
        log.info(
            "infill cut to fit",
            extra={
                "fields": {
                    "prefix_tokens": cut.prefix_tokens,
                    "suffix_tokens": cut.suffix_tokens,
                    "files": cut.files,
                }
            },
        )
    return ids


def cut_step(block_size: int, room: int) -> int:
    """How far a prefix cut moves at a time: whole KV blocks, an eighth of the room, so that a
    growing prefix moves it rarely (each move recomputes what follows it) and wastes little."""
    block = max(block_size, 1)
    return max(block, room // 8 // block * block)
