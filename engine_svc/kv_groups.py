"""KV cache groups: which layers share a block table, and which cache tensor each layer writes.

A model whose layers all attend to the whole context has one group: every layer reads one block
table, and a block id names that block in every layer's cache (one tensor per layer).

A model with sliding-window layers (Gemma 3: five of 512 to one global) keeps, for its window
layers, only the blocks their window can still read. Those layers then need tables of their own,
and the memory must be shared between kinds, or freeing a window layer's block would free nothing
the full layers could use. The layers are cut into groups of ``slots`` layers each, all of one
attention kind (``slots`` is the greatest common divisor of the kinds' layer counts: Gemma 3 270M's
3 full and 15 window layers make one full group and five window groups of 3). The cache is
``slots`` tensors of ``num_blocks`` pages; one block id (a page) belongs to one group at a time and
holds that group's layers, its i-th layer in tensor i. So a block id is one page of ``slots``
layers, every group allocates from one ``BlockPool``, and a page a window group releases is a page
a full group can take.

A window group's table keeps the sequence's logical numbering: entry i holds tokens
[i * block_size, (i + 1) * block_size); entries wholly before the window are ``NULL_BLOCK`` (a
reserved page no kernel reads: the kernels start at the window's first block)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, reduce
from math import gcd

NULL_BLOCK = 0  # reserved by the KV manager when some group has a window: never allocated


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention (keeps every block)
    layers: tuple[int, ...]  # model layer indices, in order: layer layers[j] uses cache tensor j


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    slots: int  # layers per page (cache tensors)

    @property
    def windowed(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_group(self) -> list[int]:
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return out

    def layer_slot(self) -> list[int]:
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                out[layer] = j
        return out

    def blocks_per_seq(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Pages one sequence of ``num_tokens`` holds at most, its steps computing ``chunk`` tokens
        at most: every block in a full group, the window's (and the chunk's) in a window group."""
        n = -(-num_tokens // block_size)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += n
            else:
                total += min(n, -(-(g.window - 1 + chunk) // block_size) + 1)
        return total


def layout_of(spec) -> KVLayout:
    """The KV cache groups of a ``ModelSpec`` (one group when it declares no per-layer window)."""
    kinds = spec.layer_attention or ()
    return kv_layout(tuple(a.window for a in kinds) if kinds else (None,) * spec.num_layers)


@lru_cache(maxsize=64)
def kv_layout(windows) -> KVLayout:
    """The groups of a model whose layer i has sliding window ``windows[i]`` (None: full)."""
    windows = list(windows)
    if not windows or all(w is None for w in windows):
        return KVLayout((KVGroup(None, tuple(range(len(windows)))),), len(windows))
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    # Full attention first: group 0's table is the one that holds every block.
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    slots = reduce(gcd, (len(kinds[w]) for w in order))
    groups = []
    for w in order:
        layers = kinds[w]
        for j in range(0, len(layers), slots):
            groups.append(KVGroup(w, tuple(layers[j : j + slots])))
    return KVLayout(tuple(groups), slots)
