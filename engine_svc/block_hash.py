"""Prefix-cache block hashes: deterministic, the same in every process and replica, and computable by
an external router from token ids alone (the KV-event stream names blocks by these hashes).

Definition (all integers 64-bit unsigned, bytes little-endian; ``B(x)`` is BLAKE2b with an 8-byte
digest, read as a little-endian integer):

    salt_hash  = 0 without a tenant salt, else B(utf8(salt))
    root       = B(b"llmserve-prefix-root" + u64(salt_hash))                     (base model)
    root       = B(b"llmserve-prefix-root" + u64(salt_hash) + utf8(name@version))  (a LoRA adapter:
                 its name and the engine's load counter for it, so a reload never meets old KV)
    block_hash = B(u64(parent) + i32(t0) + i32(t1) + ... + i32(t_{block_size-1}))

    root       = ... + b"|rope-phase:" + u8(1)   (a sequence longer than its long-rope model's original
                 length, whose every position the long factors rotate: docs/models.md, *Long-rope*)

where ``parent`` is ``root`` for a prompt's first block and the previous block's hash after it.
The salt never leaves the server: only its hash does. (Python's ``hash()`` was used before: it is
randomized per process for strings, so two replicas disagreed on the same prompt.)
"""

from __future__ import annotations

import sys
from array import array
from functools import lru_cache
from hashlib import blake2b

_ROOT_TAG = b"llmserve-prefix-root"
_PHASE_TAG = b"|rope-phase:"
_SWAP = sys.byteorder != "little"  # the definition is little-endian on every host


def _digest64(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


@lru_cache(maxsize=4096)
def salt_hash(salt: str | None) -> int:
    return _digest64(salt.encode()) if salt else 0


@lru_cache(maxsize=4096)
def root_hash(salt_h: int, adapter: str | None = None, rope_phase: int = 0) -> int:
    """The parent of a prompt's first block: whatever must keep two prompts' caches apart (the
    tenant's salt, a LoRA adapter's name@version, the rotary phase of a long-rope sequence) is
    folded in here."""
    tail = adapter.encode() if adapter else b""
    if rope_phase:
        tail += _PHASE_TAG + bytes([rope_phase])
    return _digest64(_ROOT_TAG + salt_h.to_bytes(8, "little") + tail)


def chain_hash(parent: int, token_ids) -> int:
    """The hash of one full block of ``token_ids`` whose predecessor's hash is ``parent``."""
    ids = array("i", token_ids)
    if _SWAP:
        ids.byteswap()
    return _digest64(parent.to_bytes(8, "little") + ids.tobytes())


def prompt_block_hashes(
    token_ids, block_size: int, salt: str | None = None, adapter: str | None = None, rope_phase: int = 0
) -> list[int]:
    """Every full block's hash of a token sequence, as the engine computes them (for routers, tests)."""
    parent, out = root_hash(salt_hash(salt), adapter, rope_phase), []
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
