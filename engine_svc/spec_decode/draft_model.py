"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens greedily.

The draft model has its own KV cache tensors (sized for its layers and heads) but uses the target's
block tables and slot mapping, so it needs no allocator of its own: every slot the target writes,
the draft writes too, in its own tensors. Each step, before the target's forward:

1. one batched forward computes, for every scheduled sequence, the tokens the target computes this
   step that are real (a prefill chunk, or a decode's last token), plus any the draft cache lacks
   (``Sequence.num_draft_computed`` lags behind after a step that accepted all k drafts). A block
   the target completes thus holds the draft's K/V as well, and a prefix-cache hit serves both;
2. for the sequences that draft, the last row's argmax is the first draft, and k - 1 single-token
   forwards (in the lookahead slots the scheduler allocated) propose the rest.

The drafts are written into the scheduler's placeholders; verification is unchanged (a draft is
accepted while it equals the target's own sample), so the output is exactly the target's. Drafted
positions past what the target accepts are overwritten later, as the target's are."""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.input_batch import InputBatch
from engine_svc.model_runner import ModelForward
from engine_svc.scheduler_output import SchedulerOutput
from engine_svc.step_inputs import StepInputs

_NO_COPIES = np.zeros((0, 2), dtype=np.int64)


class DraftModelProposer:
    def __init__(self, forward: ModelForward, block_size: int):
        self.forward = forward
        self.block_size = block_size

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, batch: InputBatch) -> None:
        """Keep the draft cache level with the target's and fill ``out.drafts`` in place. ``batch``
        must follow this step's block tables; ``out.copies`` are this step's copy-on-writes."""
        drafts = out.drafts
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        query_start, seq_lens, last_rows = [0], [], []
        for seq, n in zip(out.seqs, out.num_new, strict=True):
            c = seq.num_computed_tokens
            start = min(seq.num_draft_computed, c)
            end = c + 1 if seq in drafts else c + n  # a drafting sequence's real token is its last
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_start.append(query_start[-1] + end - start)
            seq_lens.append(end)
            seq.num_draft_computed = end
            if seq in drafts:
                last_rows.append(query_start[-1] - 1)
        rows = np.array(batch.rows(out.seqs), dtype=np.int64)
        tables = batch.gather_tables(rows)
        pos = np.array(positions, dtype=np.int64)
        token_rows = np.repeat(np.arange(len(rows)), np.diff(query_start))
        slots = tables[token_rows, pos // bs].astype(np.int64) * bs + pos % bs
        qs = np.array(query_start, dtype=np.int32)
        logits = self.forward(
            StepInputs(
                np.array(ids, dtype=np.int64),
                pos,
                slots,
                tables,
                np.array(seq_lens, dtype=np.int32),
                qs,
                np.array(last_rows, dtype=np.int64),
                out.copies,
                max_query_len=int(np.diff(qs).max()),
                max_seq_len=max(seq_lens),
            )
        )
        if not drafts:
            return
        drafting = [s for s in out.seqs if s in drafts]
        tokens = logits.argmax(dim=-1).tolist()
        for seq, token in zip(drafting, tokens, strict=True):
            drafts[seq][0] = token
        self._continue(drafting, drafts, batch)

    def _continue(self, drafting: list, drafts: dict, batch: InputBatch) -> None:
        """Drafts 2..k: one single-token forward per position, over the sequences still drafting."""
        bs = self.block_size
        for j in range(1, max(len(drafts[s]) for s in drafting)):
            live = [s for s in drafting if len(drafts[s]) > j]
            count = len(live)
            # Draft j - 1 sits just after the last real token (position len - 1 + j).
            positions = np.array([len(s.token_ids) - 1 + j for s in live], dtype=np.int64)
            rows = np.array(batch.rows(live), dtype=np.int64)
            tables = batch.gather_tables(rows)
            slots = tables[np.arange(count), positions // bs].astype(np.int64) * bs + positions % bs
            seq_lens = (positions + 1).astype(np.int32)
            logits = self.forward(
                StepInputs(
                    np.array([drafts[s][j - 1] for s in live], dtype=np.int64),
                    positions,
                    slots,
                    tables,
                    seq_lens,
                    np.arange(count + 1, dtype=np.int32),
                    np.arange(count, dtype=np.int64),
                    _NO_COPIES,
                    max_query_len=1,
                    max_seq_len=int(seq_lens.max()),
                )
            )
            for seq, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[seq][j] = token
