"""Token ids in, new text out, one step at a time, never half a UTF-8 character.

A byte-level token can end in the middle of a character; decoding then yields U+FFFD at the end.
The decoder keeps a small window of recent tokens (the prefix/read offsets of vLLM and SGLang):
text is decoded only over that window, so a step costs the same however long the sequence is, and
the window starts on a token after which everything was already complete, so decoding it alone
gives the same characters as decoding from the start. Trailing U+FFFD stays back until the
character completes (or the sequence ends: ``flush``).

``tokenizers.decoders.DecodeStream`` does the same in Rust, but it cannot hand back what it holds
when a sequence ends mid-character, and it stops with an error when a decoder's output is not
prefix-stable; this module can do both.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizer_svc.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first output token, so that decoders that treat the start
# of a text specially (SentencePiece's leading-space strip) see the output as a continuation.
_CONTEXT_TOKENS = 6
# A character is at most 4 bytes and a token carries at least one, so a character still in
# progress starts within the last 3 tokens; an incomplete tail longer than this is invalid bytes,
# emitted as U+FFFD rather than held back for ever (one token of slack for tokens that decode to
# nothing, such as a skipped special token).
_MAX_TAIL_TOKENS = 4


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens as they arrive.

    ``push(ids)`` returns only the text that became final with these ids. Over a whole sequence
    ``"".join(pushes) + flush() == tokenizer.decode(ids)`` (for byte-level tokenizers; with
    ``prompt_ids`` the text continues the prompt instead of starting a fresh text).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends mid-character: no clean place to continue from
        self._window_ids = context  # context + output, trimmed from the front as the window moves
        self._output_ids: list[int] = []
        self._read_offset = len(context)  # window_ids[:read_offset] is text already final
        self._prefix_text = self._decode(context)  # decode(window_ids[:read_offset])
        self._emitted_past_prefix = 0  # characters after prefix_text already returned
        self._pieces: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Every output token id pushed so far (do not modify)."""
        return self._output_ids

    @property
    def text(self) -> str:
        """All text returned so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output token ids; return the new text they complete (may be empty)."""
        if not token_ids:
            return ""
        self._output_ids.extend(token_ids)
        self._window_ids.extend(token_ids)
        window_text = self._decode(self._window_ids)
        if not window_text.endswith(_REPLACEMENT):
            new_text = self._emit(window_text)
            self._advance()
            return new_text
        # The last character is incomplete: release what is settled before it and hold the tail.
        new_text = self._emit(window_text.rstrip(_REPLACEMENT))
        clean = self._last_clean_boundary()
        if clean is None:
            # No character is that long: what precedes the last tokens is invalid bytes, final as
            # U+FFFD; a character in progress can only have started within those last tokens.
            clean = len(self._window_ids) - (_MAX_TAIL_TOKENS - 1)
            new_text += self._emit(self._decode(self._window_ids[:clean]))
        if clean > self._read_offset:
            self._advance_to(clean)
        return new_text

    def flush(self) -> str:
        """The sequence has ended: return what is still held back (an incomplete last character)."""
        new_text = self._emit(self._decode(self._window_ids))
        self._advance()
        return new_text

    def _emit(self, settled: str) -> str:
        start = len(self._prefix_text) + self._emitted_past_prefix
        new_text = settled[start:]
        if new_text:
            self._emitted_past_prefix += len(new_text)
            self._pieces.append(new_text)
        return new_text

    def _advance(self) -> None:
        # Everything decoded is final: the tokens read so far become the new context window.
        self._window_ids = self._window_ids[self._read_offset :]
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        self._emitted_past_prefix = 0

    def _advance_to(self, clean: int) -> None:
        """The window ends mid-character but ``window_ids[:clean]`` decodes to whole characters,
        all returned already: those tokens become final and the tail stays pending. Without this,
        pushes that keep ending mid-character would grow the window, and each step's cost, for ever."""
        base = self._read_offset
        self._window_ids = self._window_ids[base:]
        self._read_offset = clean - base
        self._prefix_text = self._decode(self._window_ids[: self._read_offset])
        # What was returned ends where the settled text ends, in this window as in the last one, or
        # at the end of the prefix when that ends in invalid bytes returned as U+FFFD.
        settled = self._decode(self._window_ids).rstrip(_REPLACEMENT)
        self._emitted_past_prefix = max(0, len(settled) - len(self._prefix_text))

    def _last_clean_boundary(self) -> int | None:
        """The largest k, no more than _MAX_TAIL_TOKENS from the end, where window_ids[:k] ends on a
        whole character (read_offset always does: what precedes it is final); None if there is none."""
        ids = self._window_ids
        for k in range(len(ids) - 1, max(self._read_offset, len(ids) - _MAX_TAIL_TOKENS) - 1, -1):
            if k == self._read_offset or not self._decode(ids[:k]).endswith(_REPLACEMENT):
                return k
        return None

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
