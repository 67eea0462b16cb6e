"""The model runner's part of the tiers: a block's bytes out of the cache tensors, and back in.

A block's payload is its page in each distinct cache tensor (``[2, block_size, kv heads,
head_dim]`` each, in ``kv_caches`` order with repeats dropped: the layers of a page), as raw bytes.
Loading writes those very bytes back, so a restored block is bitwise the block computed.

The scheduler's output lists the moves in the order the KV manager decided them (``TierOp``): a
block evicted and then reused in one schedule is read out before anything is written into it. With
tiers, the pool's copy-on-write copies are moves of that list too: a schedule may queue a copy,
release its pages (the sequence preempted) and load a tier's block into one of them, and only the
order they were decided in leaves the loaded block holding its own bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_svc.kv_tiers.entry import BlockMeta, TierEntry


@dataclass
class TierOp:
    """``save``: read pool block ``block_id`` out (``meta`` names it); ``load``: write
    ``entry``'s payload into pool block ``block_id``; ``copy``: copy pool block ``src`` into
    ``block_id`` (copy-on-write)."""

    block_id: int
    meta: BlockMeta | None = None
    entry: TierEntry | None = None
    src: int | None = None

    @property
    def kind(self) -> str:
        return "load" if self.entry is not None else "copy" if self.src is not None else "save"

    @property
    def is_save(self) -> bool:
        return self.kind == "save"


def distinct_caches(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(c): c for c in kv_caches}.values())


def block_nbytes(kv_caches: list[torch.Tensor]) -> int:
    return sum(c[:, 0].numel() * c.element_size() for c in distinct_caches(kv_caches))


def run_tier_ops(kv_caches: list[torch.Tensor], ops: list[TierOp]) -> list[TierEntry]:
    """Do ``ops`` in order (runs of one kind batched); returns the saved entries."""
    caches = distinct_caches(kv_caches)
    saved: list[TierEntry] = []
    i = 0
    while i < len(ops):
        kind = ops[i].kind
        j = i + 1
        while j < len(ops) and ops[j].kind == kind and _independent(ops[j], ops[i:j], kind):
            j += 1
        run = ops[i:j]
        if kind == "save":
            saved += _save(caches, run)
        elif kind == "load":
            _load(caches, run)
        else:
            _copy(caches, run)
        i = j
    return saved


def _independent(op: TierOp, run: list[TierOp], kind: str) -> bool:
    """Whether ``op`` may join ``run`` in one batched write: reads never conflict; a write into a
    block the run writes (a block loaded twice in one schedule) or reads (a copy's source) must
    wait for it, as must a copy reading a block the run writes."""
    if kind == "save":
        return True
    written = {o.block_id for o in run}
    if op.block_id in written:
        return False
    if kind == "copy":
        return op.src not in written and op.block_id not in {o.src for o in run}
    return True


def _save(caches: list[torch.Tensor], ops: list[TierOp]) -> list[TierEntry]:
    device = caches[0].device
    ids = torch.tensor([op.block_id for op in ops], dtype=torch.int64, device=device)
    # [n, bytes of one page] per tensor, then one row of bytes per block across the tensors.
    parts = [_bytes_rows(c.index_select(1, ids).transpose(0, 1).contiguous(), len(ops)) for c in caches]
    rows = torch.cat(parts, dim=1).cpu().numpy()
    return [TierEntry(op.meta, rows[k].copy()) for k, op in enumerate(ops)]  # each its own bytes


def _load(caches: list[torch.Tensor], ops: list[TierOp]) -> None:
    device = caches[0].device
    ids = torch.tensor([op.block_id for op in ops], dtype=torch.int64, device=device)
    rows = torch.from_numpy(np.stack([op.entry.payload for op in ops])).to(device)
    at = 0
    for c in caches:
        page = c[:, 0]
        n = page.numel() * c.element_size()
        chunk = rows[:, at : at + n].contiguous().view(c.dtype).view(len(ops), *page.shape)
        c.index_copy_(1, ids, chunk.transpose(0, 1))
        at += n
    if at != rows.shape[1]:
        raise ValueError(f"a KV tier payload of {rows.shape[1]} bytes for pages of {at} bytes")


def _copy(caches: list[torch.Tensor], ops: list[TierOp]) -> None:
    device = caches[0].device
    src = torch.tensor([op.src for op in ops], dtype=torch.int64, device=device)
    dst = torch.tensor([op.block_id for op in ops], dtype=torch.int64, device=device)
    for c in caches:  # a page's layers in every cache tensor
        c[:, dst] = c[:, src]


def _bytes_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(n, -1)
