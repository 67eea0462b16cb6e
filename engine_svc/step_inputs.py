"""One forward pass's inputs as plain integer lists, packable into a single int64 tensor so that
tensor-parallel workers receive each step with two broadcasts and no pickle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.models.decoder import AttentionInputs

HEADER_LEN = 8
CMD_STEP, CMD_STOP = 1, 2


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]  # ragged; padded when turned into a tensor
    seq_lens: list[int]
    query_start: list[int]
    logit_rows: list[int]  # flat token indices whose logits are needed (sampling, prompt logprobs)
    copies: list[tuple[int, int]]  # copy-on-write block copies to do before the forward

    @property
    def max_blocks(self) -> int:
        return max(len(t) for t in self.block_tables)

    def attention(self, device: torch.device) -> AttentionInputs:
        width = self.max_blocks
        return AttentionInputs(
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in self.block_tables], dtype=torch.int32, device=device
            ),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(self.query_start, dtype=torch.int32, device=device),
            max_query_len=max(b - a for a, b in zip(self.query_start, self.query_start[1:], strict=False)),
            max_seq_len=max(self.seq_lens),
        )

    # --- wire form for tensor-parallel workers ------------------------------------------------
    def pack(self) -> tuple[list[int], list[int]]:
        """(header, payload): the header's fixed fields say how to cut the payload."""
        width = self.max_blocks
        tables = [b for t in self.block_tables for b in t + [0] * (width - len(t))]
        payload = (
            self.input_ids
            + self.positions
            + self.slots
            + tables
            + self.seq_lens
            + self.query_start
            + self.logit_rows
            + [x for pair in self.copies for x in pair]
        )
        header = [
            CMD_STEP,
            len(self.input_ids),
            len(self.seq_lens),
            width,
            len(self.logit_rows),
            len(self.copies),
            len(payload),
            0,
        ]
        return header, payload

    @classmethod
    def unpack(cls, header: list[int], payload: list[int]) -> StepInputs:
        _, t, b, width, n_logits, n_copies, _, _ = header
        cuts = [t, t, t, b * width, b, b + 1, n_logits, 2 * n_copies]
        parts, at = [], 0
        for n in cuts:
            parts.append(payload[at : at + n])
            at += n
        ids, pos, slots, tables, seq_lens, qs, rows, copies = parts
        # Padding in the tables is harmless: the kernels read only up to each seq_len.
        return cls(
            ids,
            pos,
            slots,
            [tables[i * width : (i + 1) * width] for i in range(b)],
            seq_lens,
            qs,
            rows,
            list(zip(copies[0::2], copies[1::2], strict=True)),
        )
