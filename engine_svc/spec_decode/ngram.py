"""N-gram prompt lookup: the longest suffix of a sequence (between ``lo`` and ``hi`` tokens) that
occurred before in its own prompt and output proposes the tokens that followed it then.

The index maps each n-gram to the end of its latest earlier occurrence and is extended as tokens
arrive, so a proposal costs a few dict lookups, not a scan of the sequence. When what followed the
match runs into the sequence's end (a cycle shorter than k: the match ended one period ago), the
proposal goes on with the same period, so a short cycle still fills all k drafts."""

from __future__ import annotations


class NgramIndex:
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix (and,
        past the sequence's end, the proposal itself, one period back)."""
        length = len(tokens)
        ends = self._last_end
        for end in range(self._indexed, length):  # n-grams ending before the current suffix's end
            for n in range(self.lo, min(self.hi, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        self._indexed = length
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            end = ends.get(tuple(tokens[length - n :]))
            if end is not None:
                out = tokens[end : min(end + k, length)]
                period = length - end
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []
