"""Chat messages to token ids without special-token injection.

A chat template writes its own control markers (``<|im_start|>``, ``<|eot_id|>``) around the
messages; tokenizing the rendered text as a whole would also turn a marker's *string* inside a
user's message into the control token, letting any user forge a system turn. Here the messages'
strings are plain text and only the template's markers are special tokens:

Every string a client gave counts: roles, contents, and (with tools) the calls' names, ids and
arguments and the tools' names, descriptions and schemas, dict keys included.

1. If no such string holds a special token's string (nearly always), the rendered text's
   special tokens are all the template's own: it is encoded as a whole, exactly as before.
2. Otherwise each such string in the messages is swapped for a sentinel (a private-use character
   that none of them contains, around an index), the template is rendered, the result is cut at
   the special tokens (now only the template's), and each piece between them gets its sentinels
   swapped back and is encoded with special-token parsing off.

Cutting at special tokens is what the tokenizer itself does first (added tokens are split out
before pre-tokenizing), so the pieces' ids are those of a whole-text encode for byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen2 and this project's own).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_PRIVATE_USE = [*range(0xE000, 0xF900), *range(0xF0000, 0xF0100)]


class SpecialTokens:
    """The special-token strings of one tokenizer, as a pattern that finds them."""

    def __init__(self, strings: Sequence[str]) -> None:
        ordered = sorted(set(s for s in strings if s), key=len, reverse=True)  # longest first
        self.pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def found_in(self, text: str) -> bool:
        return self.pattern is not None and self.pattern.search(text) is not None


def _sentinel(strings: Sequence[str]) -> str:
    for code in _PRIVATE_USE[:4]:  # the quick way: the first candidates are nearly always free
        c = chr(code)
        if not any(c in s for s in strings):
            return c
    present = set().union(*(set(s) for s in strings))
    for code in _PRIVATE_USE:
        if chr(code) not in present:
            return chr(code)
    raise ValueError("the chat messages use every private-use character; cannot encode them safely")


def _strings(value, out: list[str]) -> list[str]:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(k, out)
            _strings(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _strings(v, out)
    return out


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value


def encode_chat(
    messages: list[dict],
    render: Callable[[list[dict], list[dict] | None], str],
    specials: SpecialTokens,
    encode: Callable[[str, bool], list[int]],
    token_id: Callable[[str], int],
    tools: list[dict] | None = None,
) -> list[int]:
    """``render(messages, tools)``: the template's text; ``encode(text, parse_special)``: ids
    without BOS/EOS added; ``token_id(marker)``: the id of a special token's string."""
    strings = _strings([messages, tools], [])
    if not any(specials.found_in(s) for s in strings):
        return encode(render(messages, tools), True)
    mark = _sentinel(strings)
    swapped: list[str] = []

    def hide(text: str) -> str:
        def one(m: re.Match) -> str:
            swapped.append(m.group(0))
            return f"{mark}{len(swapped) - 1}{mark}"

        return specials.pattern.sub(one, text)

    rendered = render(_map_strings(messages, hide), _map_strings(tools, hide))
    back = re.compile(f"{re.escape(mark)}(\\d+){re.escape(mark)}")
    return encode_pieces(
        rendered,
        specials,
        lambda piece: encode(back.sub(lambda m: swapped[int(m.group(1))], piece), False),
        token_id,
    )


def encode_pieces(
    text: str, specials: SpecialTokens, encode_piece: Callable[[str], Sequence[int]], token_id
) -> list[int]:
    """``text`` cut at its special tokens' strings, as the tokenizer cuts a text before
    pre-tokenizing: each non-empty piece between them through ``encode_piece``, each marker its id."""
    ids: list[int] = []
    pos = 0
    for marker in specials.pattern.finditer(text) if specials.pattern is not None else ():
        if marker.start() > pos:
            ids += encode_piece(text[pos : marker.start()])
        ids.append(token_id(marker.group(0)))
        pos = marker.end()
    if pos < len(text):
        ids += encode_piece(text[pos:])
    return ids
