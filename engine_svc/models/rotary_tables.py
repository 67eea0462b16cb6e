"""The model's rotary tables, their rows made as positions are reached.

A table has a row per position up to ``max_positions`` (per phase, with a rotary switch): at Gemma 3's
32,768 positions and head dim 256 that is 32 MiB of fp32 a table, and it holds two (local and global
theta); a Qwen2.5 / Llama table 8-16 MiB. Most of it is never read: a table's storage is an anonymous
mapping the size of the whole table, whose pages the kernel gives the process only when they are
first written, and ``RotaryTables.cover`` writes the rows of positions up to the step's highest
(in blocks of ``BLOCK`` positions) before the step reads them. The storage never moves, so the
native layer loop's pointers into it stay valid as it fills. Each row is ``rope_rows``' value, bit
for bit the row of the whole table (``rope_table``): ``tests/test_rotary_on_demand.py``.

Off the CPU (a model built under ``torch.device("cuda")``) the tables are made whole, as before.
"""

from __future__ import annotations

import torch

from engine_svc.lazy_memory import lazy_zeros
from kernels.reference.rotary import rope_phases, rope_rows, rope_table

BLOCK = 1024  # positions a growth step adds (rounded up to): 1 MiB a table at head dim 256


class RotaryTables:
    """Which rows of a model's rotary tables are written: every phase's rows of positions
    ``0 .. covered``. ``kinds``: per table, ``(head_dim, theta, scaling)``; ``phases``: the rows
    blocks a table holds (2 with a rotary switch, else 1)."""

    def __init__(self, kinds: list[tuple], max_positions: int, phases: int, lazy: bool):
        self.kinds, self.max_positions, self.phases = kinds, max_positions, phases
        self.tables: list[torch.Tensor] = []
        for head_dim, theta, scaling in kinds:
            if lazy:
                rows = max(phases, rope_phases(scaling)) * max_positions
                # a fenced lazy mapping of its own: no page resident until its rows are written
                self.tables.append(lazy_zeros((rows, head_dim), torch.float32))
            else:
                table = rope_table(head_dim, theta, scaling, max_positions)
                if phases == 2 and rope_phases(scaling) == 1:
                    table = torch.cat([table, table])
                self.tables.append(table)
        self.covered = 0 if lazy else max_positions

    def cover(self, tables: list[torch.Tensor], positions: int) -> None:
        """Write the rows of positions ``covered .. positions`` (rounded up to a ``BLOCK``, at most
        ``max_positions``) into ``tables`` (the model's buffers, in ``kinds``' order)."""
        stop = min(self.max_positions, -(-positions // BLOCK) * BLOCK)
        start = self.covered
        if stop <= start:
            return
        for table, (head_dim, theta, scaling) in zip(tables, self.kinds, strict=True):
            rows = rope_rows(head_dim, theta, scaling, start, stop)
            for phase in range(table.shape[0] // self.max_positions):
                at = phase * self.max_positions
                table[at + start : at + stop] = rows[min(phase, len(rows) - 1)].to(table.dtype)
        self.covered = stop
