"""Which drafts a step accepts: the one rule, read by the scheduler (counters, emitted tokens) and
by the proposers (what a sequence holds after the step, to draft what follows it).

Row j of a sequence verifying drafts sampled the token that follows draft[:j]. Drafts are accepted
while they equal what the target sampled at their position; the first sample that differs (or the
one after the last draft) is the bonus token. For a draft that is a single proposal (q one-hot),
taking the target's own sample is exactly the rule "accept with p(x), else resample from (p - q)+";
greedy rows make it argmax equality, and seeded rows draw their noise by position, so greedy and
seeded requests get the very tokens they would get without speculation."""

from __future__ import annotations


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """Leading drafts equal to the target's samples at their positions."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


def new_tokens(rows, drafts: dict[int, list[int]], token_ids: list[int]) -> dict[int, list[int]]:
    """Seq id -> the tokens this step adds to it (accepted drafts and the bonus token, or its one
    sample), for every sequence that samples one row group of its own (a completing ``n > 1``
    prompt forks in the update: its sequences do not exist yet, and draft from the next step).
    ``rows``: the step's ``SchedulerOutput.rows``; ``drafts``: its drafts by seq id."""
    out = {}
    r = 0
    for seq, fan in zip(rows.sampled, rows.fans, strict=True):
        draft = drafts.get(seq) if drafts else None
        if draft is not None:
            sampled = token_ids[r : r + fan]
            out[seq] = sampled[: num_accepted(draft, sampled) + 1]
        elif fan == 1:
            out[seq] = [token_ids[r]]
        r += fan
    return out
