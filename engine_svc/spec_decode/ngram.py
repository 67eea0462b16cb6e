"""N-gram prompt lookup: the longest suffix of a sequence (between ``lo`` and ``hi`` tokens) that
occurred before in its own prompt and output proposes the tokens that followed it then.

The index maps each n-gram to the end of its latest earlier occurrence and is extended as tokens
arrive, so a proposal costs a few dict lookups, not a scan of the sequence. When what followed the
match runs into the sequence's end (a cycle shorter than k: the match ended one period ago), the
proposal goes on with the same period, so a short cycle still fills all k drafts.

A corpus (``RecentOutputs.corpus``: the output of an earlier sequence whose prompt began as this
one's does, an editor's previous keystroke or an answer asked for again) is looked up first at each
n-gram length: its continuation is more likely this sequence's than whatever came last in the
prompt. Within the corpus the occurrence at or after the last one drafted from is taken (the
corpus is read forwards, as the sequence is written), else its first."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque


class NgramIndex:
    def __init__(self, lo: int, hi: int, corpus: list[int] | None = None):
        self.lo, self.hi = lo, hi
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self.corpus = list(corpus or ())
        self._corpus_ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its ends, ascending
        for end in range(lo, len(self.corpus)):  # (an n-gram at the corpus's end proposes nothing)
            for n in range(lo, min(hi, end) + 1):
                self._corpus_ends.setdefault(tuple(self.corpus[end - n : end]), []).append(end)
        self._cursor = 0  # where the corpus's last proposal began

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix's occurrence in the corpus or, at that
        length, its latest earlier occurrence in ``tokens`` (and, past the sequence's end, the
        proposal itself, one period back)."""
        length = len(tokens)
        ends = self._last_end
        for end in range(self._indexed, length):  # n-grams ending before the current suffix's end
            for n in range(self.lo, min(self.hi, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        self._indexed = length
        for n in range(min(self.hi, length), self.lo - 1, -1):
            key = tuple(tokens[length - n :])
            at = self._corpus_ends.get(key)
            if at:
                i = bisect_left(at, self._cursor)
                self._cursor = start = at[i] if i < len(at) else at[0]
                return self.corpus[start : start + k]
            end = ends.get(key) if n < length else None
            if end is not None:
                out = tokens[end : min(end + k, length)]
                period = length - end
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []


def shared_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit`` (slices compared in halves:
    a few C-level comparisons, not a Python loop over the tokens)."""
    lo, hi = 0, min(len(a), len(b), len(a) if limit is None else limit)
    while lo < hi:  # a[:lo] == b[:lo]; the answer is at most hi
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RecentOutputs:
    """The last ``capacity`` sequences that finished after drafting: their tenant, prompt length and
    tokens. ``corpus`` gives a new sequence the output of the one whose prompt shares the most of
    its own (at least half of it, and within its tenant), with the last ``tail`` tokens of that
    prompt before it (so that a lookup at the end of the new prompt finds where the old output
    began). An editor's keystrokes are such a run: each request's prompt is the last one's with a
    character more, and its completion mostly the last one's shifted by it."""

    def __init__(self, capacity: int = 16, tail: int = 16):
        self.entries: deque[tuple[tuple[int, int], int, list[int]]] = deque(maxlen=capacity)
        self.tail = tail

    def add(self, group: tuple[int, int], num_prompt_tokens: int, tokens: list[int]) -> None:
        if len(tokens) > num_prompt_tokens:
            self.entries.append((group, num_prompt_tokens, tokens))

    def corpus(self, group: tuple[int, int], prompt: list[int]) -> list[int]:
        best, best_shared = None, 0
        for entry in reversed(self.entries):  # the latest first: it wins a tie
            if entry[0] != group:
                continue
            shared = shared_prefix(entry[2], prompt, entry[1])  # (its prompt: the first entry[1])
            if shared > best_shared:
                best, best_shared = entry, shared
        if best is None or 2 * best_shared < len(prompt):
            return []
        _, num_prompt, tokens = best
        return tokens[max(0, num_prompt - self.tail) :]
