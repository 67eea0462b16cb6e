"""One block of the lower tiers, and its disk file.

A block's payload is the bytes of its page in every cache tensor (``transfer.py``), exactly as
computed. On disk an entry is one file, a fixed little-endian layout (no pickle):

    magic     8 bytes  b"LLMSKV01"
    header    u32 length, then: fingerprint (16 bytes), key u64, parent u64, salt u64, listed u8,
              num_tokens u32, token ids i32 * num_tokens, payload_len u64
    checksum  u32: CRC-32 of the header bytes and the payload
    payload   payload_len bytes

``decode`` refuses (``BadEntry``, saying why) a file that is truncated, longer than it says,
fails its checksum, or belongs to another fingerprint, key or token sequence: such an entry is
skipped and counted, never used.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = b"LLMSKV01"
_FIXED = struct.Struct("<16sQQQBI")  # fingerprint, key, parent, salt, listed, num_tokens
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class BadEntry(ValueError):
    """A stored entry that must not be used; the message says why."""


@dataclass
class BlockMeta:
    """What the pool needs to publish a restored block: its key, tokens and place in its chain."""

    key: int
    token_ids: tuple[int, ...]
    parent: int = 0
    salt: int = 0
    listed: bool = True


@dataclass
class TierEntry:
    meta: BlockMeta
    payload: np.ndarray  # uint8, the block's bytes in every cache tensor

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)


def encode(entry: TierEntry, fingerprint: bytes) -> list[bytes | memoryview]:
    """The file's bytes, as pieces to write in order (the payload is not copied)."""
    m = entry.meta
    tokens = np.asarray(m.token_ids, dtype="<i4").tobytes()
    payload = memoryview(np.ascontiguousarray(entry.payload)).cast("B")
    header = (
        _FIXED.pack(fingerprint, m.key, m.parent, m.salt, int(m.listed), len(m.token_ids))
        + tokens
        + _U64.pack(len(payload))
    )
    crc = zlib.crc32(payload, zlib.crc32(header))
    return [MAGIC, _U32.pack(len(header)), header, _U32.pack(crc), payload]


def decode(data: bytes, fingerprint: bytes, key: int, token_ids: tuple[int, ...] | None) -> TierEntry:
    """The entry a file holds, checked: ``BadEntry`` unless it is whole, intact, and this
    fingerprint's entry for ``key`` (and ``token_ids``, when given)."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + 4 or bytes(view[:8]) != MAGIC:
        raise BadEntry("not a KV tier entry (bad magic)" if len(view) >= 8 else "truncated")
    (hlen,) = _U32.unpack_from(view, 8)
    start = 12
    if hlen < _FIXED.size + 8 or len(view) < start + hlen + 4:
        raise BadEntry("truncated header")
    header = view[start : start + hlen]
    fp, k, parent, salt, listed, n = _FIXED.unpack_from(header, 0)
    if hlen != _FIXED.size + 4 * n + 8:
        raise BadEntry("header length disagrees with its token count")
    (plen,) = _U64.unpack_from(header, _FIXED.size + 4 * n)
    (crc,) = _U32.unpack_from(view, start + hlen)
    body = start + hlen + 4
    if len(view) != body + plen:
        raise BadEntry(f"payload is {len(view) - body} bytes, the header says {plen}")
    payload = view[body:]
    if zlib.crc32(payload, zlib.crc32(header)) != crc:
        raise BadEntry("checksum mismatch")
    if fp != fingerprint:
        raise BadEntry("foreign entry (another model, dtype, block size, KV layout or tokenizer)")
    if k != key:
        raise BadEntry(f"entry holds key {k:016x}, not {key:016x}")
    tokens = tuple(np.frombuffer(header, dtype="<i4", count=n, offset=_FIXED.size).tolist())
    if token_ids is not None and tokens != tuple(token_ids):
        raise BadEntry("token ids differ from the block looked up (a hash collision)")
    meta = BlockMeta(k, tokens, parent, salt, bool(listed))
    return TierEntry(meta, np.frombuffer(data, dtype=np.uint8, offset=body))
