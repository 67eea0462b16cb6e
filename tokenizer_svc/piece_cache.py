"""The token ids of a rendered chat prompt's long pieces, kept from one request to the next.

An agent's or a chat client's turns resend the same long system prompt (instructions, tool schemas,
project notes: 18k tokens in Claude Code's case) with a little more after it each time, and
encoding all of it again took ~46 ms a turn on Qwen2.5's 0.5B tokenizer. A rendered prompt is cut at
its special tokens' strings (the template's markers), as the tokenizer itself cuts a text before
pre-tokenizing; a piece between two markers is then encoded alone, and a long piece's ids are kept
(least recently used out first, bounded in characters), so an unchanged system message costs a
lookup.

Cutting is exact only where nothing in the tokenizer looks across a piece's ends: ``piecewise_exact``
says so for a tokenizer (no normalizer or pre-tokenizer that prepends by position, no special token
that strips the whitespace beside it); elsewhere the text is encoded whole, as before. Tests:
``tests/test_piece_cache.py`` (real tokenizers, random chat texts, against the whole-text encode).
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Callable

# A piece shorter than this is encoded again each time: its encode costs less than keeping it.
MIN_CHARS = 1024
# The characters of the pieces kept (one tokenizer; about 5 bytes per character with their ids).
MAX_CHARS = 4 * 1024 * 1024

_POSITIONAL = ("Metaspace", "Prepend", '"add_prefix_space":true', '"prepend_scheme"')


def piecewise_exact(hf_tokenizer) -> bool:
    """Whether ``hf_tokenizer`` (a fast one) encodes a text cut at its special tokens' strings to
    the ids of the whole text: its normalizer and pre-tokenizer treat every piece alike (none adds a
    prefix to a text's start only), and no special token strips or normalizes what is beside it."""
    backend = hf_tokenizer.backend_tokenizer
    for part in (backend.normalizer, backend.pre_tokenizer):
        if part is not None:
            state = json.loads(part.__getstate__())
            text = json.dumps(state, separators=(",", ":"))
            if any(word in text for word in _POSITIONAL):
                return False
    for token in hf_tokenizer.added_tokens_decoder.values():
        if token.special and (token.lstrip or token.rstrip or token.single_word or token.normalized):
            return False
    return True


class PieceCache:
    """Ids of long pieces by their text, least recently used out first. One thread at a time (a
    tokenizer worker's, or the event loop's), as the tokenizer it serves."""

    def __init__(self, max_chars: int = MAX_CHARS, min_chars: int = MIN_CHARS) -> None:
        self.max_chars, self.min_chars = max_chars, min_chars
        self._ids: OrderedDict[str, array] = OrderedDict()
        self.chars = 0
        self.hits = self.misses = 0

    def ids(self, piece: str, encode: Callable[[str], list[int]]):
        """``encode(piece)``'s ids (kept for a long piece; a sequence of ints)."""
        if len(piece) < self.min_chars or len(piece) > self.max_chars:
            return encode(piece)
        kept = self._ids.get(piece)
        if kept is not None:
            self._ids.move_to_end(piece)
            self.hits += 1
            return kept
        self.misses += 1
        kept = self._ids[piece] = array("i", encode(piece))
        self.chars += len(piece)
        while self.chars > self.max_chars:
            old, _ = self._ids.popitem(last=False)
            self.chars -= len(old)
        return kept
