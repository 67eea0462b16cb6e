"""One forward pass's inputs as integer numpy arrays, packable into a single int64 tensor so that
tensor-parallel workers receive each step with two broadcasts and no pickle.

Arrays rather than lists: a tensor made with ``torch.from_numpy`` shares the array's memory, where
``torch.tensor(list)`` walks a Python list element by element (tens of microseconds per call at a
few hundred rows, several calls per step)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_svc.models.decoder import AttentionInputs

HEADER_LEN = 8
CMD_STEP, CMD_STOP, CMD_LORA_LOAD = 1, 2, 3


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
    lora: object = None  # engine_svc.lora.batch.LoRABatch of this step (its token slots are packed)
    lora_slots: np.ndarray | None = None  # unpacked by a tensor-parallel worker: [T] slot per token

    def attention(self, device: torch.device) -> AttentionInputs:
        return AttentionInputs(
            slot_mapping=to_device(self.slots, device),
            block_tables=to_device(self.block_tables, device),
            seq_lens=to_device(self.seq_lens, device),
            query_start_loc=to_device(self.query_start, device),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )

    # --- wire form for tensor-parallel workers ------------------------------------------------
    def pack(self) -> tuple[list[int], np.ndarray]:
        """(header, payload): the header's fixed fields say how to cut the payload."""
        b, width = self.block_tables.shape
        lora_slots = self.lora.token_slots_host if self.lora is not None else np.empty(0, np.int64)
        payload = np.concatenate(
            [
                self.input_ids,
                self.positions,
                self.slots,
                self.block_tables.reshape(-1),
                self.seq_lens,
                self.query_start,
                self.logit_rows,
                self.copies.reshape(-1),
                lora_slots,
            ]
        ).astype(np.int64, copy=False)
        header = [CMD_STEP, len(self.input_ids), b, width, len(self.logit_rows), len(self.copies)]
        header += [len(payload), len(lora_slots)]
        return header, payload

    @classmethod
    def unpack(cls, header: list[int], payload: np.ndarray) -> StepInputs:
        _, t, b, width, n_logits, n_copies, _, n_lora = header
        cuts = [t, t, t, b * width, b, b + 1, n_logits, 2 * n_copies, n_lora]
        parts, at = [], 0
        for n in cuts:
            parts.append(payload[at : at + n])
            at += n
        ids, pos, slots, tables, seq_lens, qs, rows, copies, lora_slots = parts
        seq_lens = seq_lens.astype(np.int32)
        qs = qs.astype(np.int32)
        return cls(
            ids,
            pos,
            slots,
            tables.astype(np.int32).reshape(b, width),
            seq_lens,
            qs,
            rows,
            copies.reshape(n_copies, 2),
            max_query_len=int(np.diff(qs).max()),
            max_seq_len=int(seq_lens.max()),
            lora_slots=lora_slots if n_lora else None,
        )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=False)
