"""``min_tokens``: no stop token (nor EOS, unless ignored) before that many outputs."""

from __future__ import annotations

from engine_svc import input_batch as ib
from engine_svc.logits_processors.base import LogitsProcessor, ban
from engine_svc.sampling_params import banned_until_min_tokens


def stop_ids_banned_now(state) -> list[int]:
    """``state``: the runner's ``RequestState`` of the row's sequence."""
    p = state.params
    if p.min_tokens and state.num_output_tokens < p.min_tokens:
        return banned_until_min_tokens(p, p.eos_token_ids)
    return []


class MinTokens(LogitsProcessor):
    flag = ib.MIN_TOKENS
    constraint = False

    def prepare(self, rows, out):
        banned = [stop_ids_banned_now(s) for s, *_ in rows]
        return banned if any(banned) else None

    def apply(self, logits, banned, batch):
        return ban(logits, banned)
