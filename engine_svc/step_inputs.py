"""One forward pass's inputs as integer numpy arrays. Every rank builds its own from the step's
``SchedulerOutput`` (tensor-parallel workers receive that, not these).

Arrays rather than lists: a tensor made with ``torch.from_numpy`` shares the array's memory, where
``torch.tensor(list)`` walks a Python list element by element (tens of microseconds per call at a
few hundred rows, several calls per step).

``paged_inputs`` and ``decode_inputs`` are the one place that turns "these sequences compute these
tokens at these positions" into positions, slot mapping and block tables: the model runner builds
the target's step with them, and the draft-model proposer its own forwards (same blocks, same slots)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_svc.input_batch import InputBatch
from engine_svc.models.decoder import AttentionInputs


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, width] int32; padding past a row's blocks is never read
    seq_lens: np.ndarray  # [B] int32
    query_start: np.ndarray  # [B + 1] int32
    logit_rows: np.ndarray  # [L] int64: flat token indices whose logits are needed
    copies: np.ndarray  # [C, 2] int64: copy-on-write (src, dst) block copies before the forward
    max_query_len: int
    max_seq_len: int
    lora: object = None  # engine_svc.lora.batch.LoRABatch of this step
    # With several KV cache groups (sliding-window layers): every group's slots [G, T] and block
    # tables [G, B, width]; ``slots`` and ``block_tables`` are then group 0's.
    group_slots: np.ndarray | None = None
    group_tables: np.ndarray | None = None

    def attention(self, device: torch.device) -> AttentionInputs:
        grouped = self.group_slots is not None
        return AttentionInputs(
            slot_mapping=to_device(self.slots, device),
            block_tables=to_device(self.block_tables, device),
            seq_lens=to_device(self.seq_lens, device),
            query_start_loc=to_device(self.query_start, device),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            group_slots=to_device(self.group_slots, device) if grouped else None,
            group_tables=to_device(self.group_tables, device) if grouped else None,
        )


def paged_inputs(
    batch: InputBatch,
    block_size: int,
    seq_ids: list[int],
    input_ids: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    logit_rows: np.ndarray,
    copies: np.ndarray,
) -> StepInputs:
    """Sequence ``seq_ids[i]`` computes ``counts[i]`` tokens from position ``starts[i]`` on
    (``input_ids`` holds them, sequence after sequence); each writes its K/V into its own blocks
    (``batch``'s tables)."""
    rows = np.array(batch.rows(seq_ids), dtype=np.int64)
    grouped = _grouped_tables(batch, rows)
    tables = batch.gather_tables(rows) if grouped is None else grouped[0]
    query_start = np.zeros(len(seq_ids) + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start[1:])
    token_rows = np.repeat(np.arange(len(seq_ids)), counts)
    # Position of each token: its sequence's start plus its offset within the sequence's span.
    positions = np.arange(int(query_start[-1]), dtype=np.int64) + np.repeat(starts - query_start[:-1], counts)
    seq_lens = (starts + counts).astype(np.int32)
    slots = _slots(tables if grouped is None else grouped, token_rows, positions, block_size)
    return StepInputs(
        input_ids,
        positions,
        slots if grouped is None else slots[0],
        tables,
        seq_lens,
        query_start,
        logit_rows,
        copies,
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
        group_slots=None if grouped is None else slots,
        group_tables=grouped,
    )


def decode_inputs(
    batch: InputBatch,
    block_size: int,
    seq_ids: list[int],
    input_ids: np.ndarray,
    positions: np.ndarray,
    copies,
) -> StepInputs:
    """The one-token case of ``paged_inputs`` (every sequence computes one token and needs its
    logits), with no ragged arrays: the steady decode step takes this path."""
    count = len(seq_ids)
    rows = np.array(batch.rows(seq_ids), dtype=np.int64)
    grouped = _grouped_tables(batch, rows)
    tables = batch.gather_tables(rows) if grouped is None else grouped[0]
    seq_lens = (positions + 1).astype(np.int32)
    slots = _slots(tables if grouped is None else grouped, np.arange(count), positions, block_size)
    return StepInputs(
        input_ids,
        positions,
        slots if grouped is None else slots[0],
        tables,
        seq_lens,
        np.arange(count + 1, dtype=np.int32),
        np.arange(count, dtype=np.int64),
        copies,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        group_slots=None if grouped is None else slots,
        group_tables=grouped,
    )


def _grouped_tables(batch: InputBatch, rows: np.ndarray) -> np.ndarray | None:
    """[G, B, width] tables of every KV cache group, or None with one group."""
    return batch.gather_group_tables(rows) if len(batch.group_tables) > 1 else None


def _slots(tables: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each token: its block (from its sequence's table) and its offset in it;
    with tables [G, B, width], one row of slots per KV cache group."""
    blocks = tables[..., token_rows, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=False)
