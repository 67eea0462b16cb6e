"""Length-prefixed frames: a 4-byte little-endian length, then that many bytes of protobuf.

Pipes carry a byte stream, not messages; the prefix puts the message boundaries back.
"""

from __future__ import annotations

import asyncio
import struct
from typing import BinaryIO

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30  # a corrupt length must not make a reader allocate without bound


class FrameError(RuntimeError):
    """The byte stream does not hold a well-formed frame."""


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return _HEADER.pack(len(payload)) + payload


def _length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame header announces {length} bytes, over the limit")
    return length


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's payload, or None at a clean end of stream."""
    header = stream.read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise FrameError("stream ended inside a frame header")
    length = _length(header)
    payload = stream.read(length)
    if len(payload) < length:
        raise FrameError("stream ended inside a frame")
    return payload


async def read_frame_async(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload, or None at a clean end of stream."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("stream ended inside a frame header") from exc
    try:
        return await reader.readexactly(_length(header))
    except asyncio.IncompleteReadError as exc:
        raise FrameError("stream ended inside a frame") from exc
