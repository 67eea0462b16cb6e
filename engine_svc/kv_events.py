"""KV-cache events for KV-aware routers (vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` design): what entered and left the prefix cache, named by block hashes
(``block_hash.py``), never by token ids or text.

The block pool appends to a ``KvEventLog`` only while someone listens (``BlockPool.events`` is None
otherwise, so the cost is one attribute test). Consecutive stores of one chain (each block's parent
is the previous one) and consecutive removals merge into one event, as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockStored:
    block_hashes: list[int]  # a chain: each one's parent is the one before it
    parent_block_hash: int  # of the first; a prompt's first block has the root (block_hash.root_hash)
    block_size: int  # tokens in each block
    salt_hash: int  # the tenant salt's hash (0: none)


@dataclass
class BlockRemoved:
    block_hashes: list[int]


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class KvEventLog:
    block_size: int
    events: list = field(default_factory=list)

    def stored(self, block_hash: int, parent: int, salt_h: int) -> None:
        last = self.events[-1] if self.events else None
        if type(last) is BlockStored and last.block_hashes[-1] == parent and last.salt_hash == salt_h:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockStored([block_hash], parent, self.block_size, salt_h))

    def removed(self, block_hash: int) -> None:
        last = self.events[-1] if self.events else None
        if type(last) is BlockRemoved:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.clear()  # whatever came before is moot for a listener
        self.events.append(AllBlocksCleared())

    def take(self) -> list:
        out, self.events = self.events, []
        return out
