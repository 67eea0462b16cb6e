"""Structured output: each constrained row keeps only the tokens its grammar (an llguidance
matcher, compiled off the loop) allows next; a sequence verifying drafts gets one mask per
position."""

from __future__ import annotations

import torch

from engine_svc import input_batch as ib
from engine_svc.logits_processors.base import LogitsProcessor


class GrammarMask(LogitsProcessor):
    flag = ib.GRAMMAR
    constraint = True

    def __init__(self, executor):
        self.executor = executor  # llguidance.LLExecutor: fills the rows' masks in parallel

    def prepare(self, rows, layout):
        matchers = [s.matcher for s, *_ in rows]
        if all(m is None for m in matchers):
            return None
        return matchers, (_grammar_drafts(layout) if layout.drafts is not None else None)

    def apply(self, logits, state, batch):
        matchers, drafts = state
        apply_grammar_masks(logits, matchers, self.executor, drafts)
        return logits


def _grammar_drafts(layout) -> dict[int, list[int]]:
    """First sample row of each constrained sequence verifying drafts -> its drafts: rows r + 1 ..
    r + k get the masks of the states after drafts[:1] .. drafts[:k]."""
    out, r = {}, 0
    for s, fan, draft in zip(layout.sampled, layout.fans, layout.drafts, strict=True):
        if draft is not None and s.matcher is not None:
            out[r] = draft
        r += fan
    return out


def apply_grammar_masks(
    logits: torch.Tensor, matchers: list, executor, drafts: dict[int, list[int]] | None = None
) -> None:
    """Each constrained row keeps only the tokens its grammar allows next. The masks of all rows
    are filled in parallel calls; rows sharing a matcher (an n > 1 prompt about to fork) are
    filled once and copied. A sequence verifying drafts has a row per position: llguidance
    advances its matcher through the drafts, fills each position's mask, and rolls it back (a
    draft the grammar refuses stops the walk there: the rows after it stay unmasked, and are never
    used, since the target cannot sample a refused draft and verification stops at it)."""
    import llguidance.torch as lt

    drafts = drafts or {}
    rows = [r for r, m in enumerate(matchers) if m is not None]
    covered = {r + 1 + j for r, d in drafts.items() for j in range(len(d))}  # filled with their first row
    first: dict[int, int] = {}  # id(matcher) -> its row in the mask
    for i, r in enumerate(rows):
        if r not in covered:
            first.setdefault(id(matchers[r]), i)
    mask = lt.allocate_token_bitmask(len(rows), logits.shape[1])
    plain = [(matchers[rows[i]], i) for i in first.values() if rows[i] not in drafts]
    if plain:
        lt.fill_next_token_bitmask_par(executor, plain, mask)
    drafting = [(matchers[rows[i]], i, drafts[rows[i]]) for i in first.values() if rows[i] in drafts]
    if drafting:
        lt.fill_next_token_bitmask_par_with_draft_tokens(executor, drafting, mask)
    for i, r in enumerate(rows):
        if r in covered:
            continue
        j = first[id(matchers[r])]
        if j != i:
            mask[i] = mask[j]
    bits = (mask.to(logits.device).unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1  # [rows, words, 32]
    allowed = bits.view(len(rows), -1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # token 32*w + b is allowed when bit b of word w is set
