"""``bad_words_token_ids``: a word's last token is banned where the output ends with the tokens
before it (a one-token word always); elsewhere that token stays allowed."""

from __future__ import annotations

from engine_svc import input_batch as ib
from engine_svc.logits_processors.base import LogitsProcessor, ban


def last_tokens_banned_now(state) -> list[int]:
    """``state``: the runner's ``RequestState`` of the row's sequence."""
    words = state.params.bad_words_token_ids
    if not words:
        return []
    output = state.output_token_ids
    banned = []
    for word in words:
        k = len(word) - 1
        if k == 0 or (len(output) >= k and output[len(output) - k :] == word[:-1]):
            banned.append(word[-1])
    return banned


class BadWords(LogitsProcessor):
    flag = ib.LOGIT_CONTROLS
    constraint = False

    def prepare(self, rows, out):
        banned = [last_tokens_banned_now(s) for s, *_ in rows]
        return banned if any(banned) else None

    def apply(self, logits, banned, batch):
        return ban(logits, banned)
