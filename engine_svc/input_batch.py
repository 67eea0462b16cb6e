"""Per-sequence state that lives across steps, in preallocated numpy arrays (vLLM v1's persistent
input batch, reduced to what changes rarely).

A sequence holds a row while it holds KV blocks. Its row's block table is rewritten only from the
first entry that changed (a new block, a copy-on-write, a prefix hit, a fork), and its sampling
parameters are written once when it joins. Each step then gathers the scheduled rows with one
numpy index instead of rebuilding padded lists of every running sequence.
"""

from __future__ import annotations

import numpy as np

from engine_svc.sampling_params import SamplingParams

# Sampling columns, one float32 row per sequence (top_k fits exactly: vocabularies are < 2**24).
TEMPERATURE, TOP_K, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(7)
NUM_SAMPLING_COLS = 7
# Per-row flags that send a step off the plain path: each needs per-row Python in the sampler.
SEEDED, LOGPROBS, PENALTY, MIN_TOKENS, LOGIT_CONTROLS, GRAMMAR = range(6)
NUM_FLAGS = 6


class InputBatch:
    def __init__(self, max_blocks_per_seq: int, rows: int = 64, groups: int = 1):
        """``groups``: KV cache groups (``engine_svc/kv_groups.py``), one block table each."""
        width = max(1, max_blocks_per_seq)
        self.group_tables = [np.zeros((rows, width), dtype=np.int32) for _ in range(groups)]
        self.group_num_blocks = [np.zeros(rows, dtype=np.int32) for _ in range(groups)]
        self.sampling = np.zeros((rows, NUM_SAMPLING_COLS), dtype=np.float32)
        self.flags = np.zeros((rows, NUM_FLAGS), dtype=bool)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(rows - 1, -1, -1))  # a stack: the lowest row is reused first

    @property
    def block_tables(self) -> np.ndarray:
        """Group 0's tables (the only group of a model without sliding windows)."""
        return self.group_tables[0]

    @property
    def num_blocks(self) -> np.ndarray:
        return self.group_num_blocks[0]

    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    def apply(self, updates, released, new=()) -> None:
        """Follow the KV cache's changes as the scheduler's output carries them: ``released`` seq ids
        lose their rows; each sequence of ``new`` (``NewRequestData``) takes a row, its sampling
        parameters written once and its whole tables; each ``BlockUpdate`` rewrites its sequence's
        table from ``first`` on."""
        row_of = self.row_of
        for seq_id in released:
            row = row_of.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)
        for request in new:
            row = row_of.get(request.seq_id)
            if row is None:
                row = self._add(request.seq_id, request.params)
            for g, ids in enumerate(request.block_ids):
                self._write(row, g, 0, ids)
        for update in updates:
            row = row_of.get(update.seq_id)
            if row is None:
                raise KeyError(f"sequence {update.seq_id}'s table changed before the batch held it")
            self._write(row, update.group, update.first, update.block_ids)

    def _write(self, row: int, group: int, first: int, ids: list[int]) -> None:
        n = first + len(ids)
        if n > self.block_tables.shape[1]:
            self._widen(n)
        self.group_tables[group][row, first:n] = ids
        self.group_num_blocks[group][row] = n

    def rows(self, seq_ids) -> list[int]:
        row_of = self.row_of
        return [row_of[i] for i in seq_ids]

    def gather_tables(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), width] block tables, width the longest of them."""
        width = int(self.num_blocks[rows].max())
        return self.block_tables[rows, :width]

    def gather_group_tables(self, rows: np.ndarray) -> np.ndarray:
        """[groups, len(rows), width] block tables of every KV cache group (all groups of a
        sequence have the same length between steps)."""
        width = max(int(n[rows].max()) for n in self.group_num_blocks)
        return np.stack([t[rows, :width] for t in self.group_tables])

    def _add(self, seq_id: int, p: SamplingParams) -> int:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[seq_id] = row
        self.sampling[row] = (
            0.0 if p.greedy else p.temperature,
            p.top_k if p.top_k > 0 else 0,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        self.flags[row] = (
            p.seed is not None,
            p.logprobs is not None,
            p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty),
            p.min_tokens > 0,
            p.has_logit_controls,
            p.structured_outputs is not None,
        )
        return row

    def _grow(self) -> None:
        old = len(self.num_blocks)
        self.group_tables = [_resize(t, 2 * old) for t in self.group_tables]
        self.group_num_blocks = [_resize(n, 2 * old) for n in self.group_num_blocks]
        self.sampling = _resize(self.sampling, 2 * old)
        self.flags = _resize(self.flags, 2 * old)
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        rows, old = self.block_tables.shape
        widened = []
        for table in self.group_tables:
            wider = np.zeros((rows, max(width, 2 * old)), np.int32)
            wider[:, :old] = table
            widened.append(wider)
        self.group_tables = widened


def _resize(array: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    out[: len(array)] = array
    return out
