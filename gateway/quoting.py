"""Client strings in errors and logs: a short prefix, never the whole thing.

A 15 MiB ``model`` echoed into an error makes trailers too large for gRPC (the client then sees
RESOURCE_EXHAUSTED instead of the real error) and fills the log; a prefix is enough to recognise it.
"""

from __future__ import annotations

QUOTE_CHARS = 64


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """``repr`` of at most ``limit`` characters of ``value``, saying how long the whole was."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def clip(message: str, limit: int = 256) -> str:
    """A message that may quote client input (a template's error, a tokenizer's), cut to ``limit``."""
    return message if len(message) <= limit else message[:limit] + f"... ({len(message)} characters)"


def utf8_len_over(text: str, limit: int) -> int | None:
    """The UTF-8 length of ``text`` if it is over ``limit``, else None; encodes only when the
    character count cannot decide (a character is 1 to 4 bytes)."""
    if len(text) > limit:
        return len(text.encode("utf-8", "surrogatepass"))
    if 4 * len(text) <= limit:
        return None
    n = len(text.encode("utf-8", "surrogatepass"))
    return n if n > limit else None
