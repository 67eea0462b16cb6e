"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens greedily.

The draft model has its own KV cache tensors (sized for its layers and heads) but uses the target's
block tables and slot mapping, and builds its forwards with the runner's own input builder
(``step_inputs.paged_inputs``), so it needs no allocator and no slot arithmetic of its own: every
slot the target writes, the draft writes too, in its own tensors. Each step, after the target
sampled:

1. one batched forward computes, for every scheduled sequence, the tokens the target computed this
   step that are real (a prefill chunk, a decode's last token, a verification's accepted drafts),
   plus any the draft cache lacks (``computed``, the proposer's own record per seq id), and, for a
   sequence that drafts, the tokens just sampled: the last row's argmax is its first draft. A block
   the target completes thus holds the draft's K/V as well, and a prefix-cache hit serves both;
2. k - 1 single-token forwards propose the rest, in the lookahead slots that the scheduler allocated
   with the step (it keeps the blocks they lie in until the drafts are verified).

The drafts go back in the step's result; verification takes the target's own samples, so the
output is exactly the target's. Drafted positions past what the target accepts are overwritten
later, as the target's are.

By the end of every step the draft cache holds at least every token the target has computed (a
block the target completes holds the draft's K/V too), so the scheduler publishes blocks without
asking how far the draft got."""

from __future__ import annotations

import numpy as np

from engine_svc.input_batch import InputBatch
from engine_svc.model_runner import ModelForward
from engine_svc.runner_state import RequestStates
from engine_svc.sampler import DEAD_END_TOKEN
from engine_svc.scheduler_output import NO_COPIES, SchedulerOutput
from engine_svc.spec_decode.acceptance import new_tokens
from engine_svc.spec_decode.proposer import room
from engine_svc.step_inputs import decode_inputs, paged_inputs
from engine_svc.torch_modes import inference


class DraftModelProposer:
    def __init__(self, forward: ModelForward, block_size: int):
        self.forward = forward
        self.block_size = block_size
        # Per seq id, while it holds blocks: leading tokens whose K/V the draft cache holds, and
        # the drafts proposed after them (the K/V of all but the last lie past those tokens).
        self.computed: dict[int, int] = {}
        self.drafted: dict[int, int] = {}

    def follow(self, forks: list[tuple[int, int]], released: list[int]) -> None:
        """A fork shares its parent's blocks, and so what the draft cache holds in them."""
        computed, drafted = self.computed, self.drafted
        for parent, child in forks:
            if parent in computed:
                computed[child] = computed[parent]
        for seq_id in released:
            computed.pop(seq_id, None)
            drafted.pop(seq_id, None)

    def held_ids(self) -> set[int]:
        return set(self.computed) | set(self.drafted)

    @inference
    def propose(
        self, out: SchedulerOutput, token_ids: list[int], states: RequestStates, batch: InputBatch
    ) -> dict[int, list[int]]:
        """Keep the draft cache level with the target's and draft for ``out.propose``. ``out.copies``
        are this step's copy-on-writes: the draft's cache takes them too."""
        added = new_tokens(out.rows, out.drafts, token_ids) if out.rows.sampled else {}
        seqs, ids, starts, counts = [], [], [], []
        drafting: list[tuple] = []  # (seq id, drafts it may take, tokens it has after this step)
        computed, drafted = self.computed, self.drafted
        for seq_id, n in zip(out.seq_ids, out.num_scheduled, strict=True):
            seq = states[seq_id]
            c, length = seq.num_computed_tokens, len(seq.token_ids)
            new = added.get(seq_id, [])
            verified = out.drafts.get(seq_id)
            held = computed.get(seq_id, 0)
            if verified is not None and held == c + 1:
                # The draft cache holds the last token and, from the drafting, the accepted drafts
                # but the last one proposed (its successor was never drafted from).
                accepted = len(new) - 1
                start = c + 1 + min(accepted, drafted.get(seq_id, 0) - 1)
                end = c + 1 + accepted
            else:
                start = min(held, c)
                end = c + n if verified is None else c + len(new)
            drafted[seq_id] = 0
            k = out.propose.get(seq_id, 0)
            if k and new and new[-1] != DEAD_END_TOKEN:
                k = room(seq, length + len(new), k)
                if k > 0:
                    end = length + len(new)  # and the sampled tokens, to draft from the last one
                    drafting.append((seq_id, k, end))
            computed[seq_id] = end
            if end > start:
                seqs.append(seq_id)
                ids += _span(seq.token_ids, new, start, end)
                starts.append(start)
                counts.append(end - start)
        if not seqs:
            self.forward.copy_blocks(out.copies)
            return {}
        counts = np.array(counts, dtype=np.int64)
        last_rows = np.cumsum(counts) - 1
        row_of = {s: i for i, s in enumerate(seqs)}
        inputs = paged_inputs(
            batch,
            self.block_size,
            seqs,
            np.array(ids, dtype=np.int64),
            np.array(starts, dtype=np.int64),
            counts,
            np.array([last_rows[row_of[s]] for s, _, _ in drafting], dtype=np.int64),
            out.copies,
        )
        logits = self.forward(inputs)
        if not drafting:
            return {}
        firsts = logits.argmax(dim=-1).tolist()
        drafts = {s: [t] for (s, _, _), t in zip(drafting, firsts, strict=True)}
        self._continue(drafting, drafts, batch)
        for seq_id, draft in drafts.items():
            drafted[seq_id] = len(draft)
        return drafts

    def _continue(self, drafting: list, drafts: dict, batch: InputBatch) -> None:
        """Drafts 2..k: one single-token forward per position, over the sequences still drafting."""
        for j in range(1, max(k for _, k, _ in drafting)):
            live = [(s, end) for s, k, end in drafting if k > j]
            seqs = [s for s, _ in live]
            # Draft j (0-based) is computed from draft j - 1, which sits at position end - 1 + j.
            positions = np.array([end - 1 + j for _, end in live], dtype=np.int64)
            ids = np.array([drafts[s][j - 1] for s in seqs], dtype=np.int64)
            logits = self.forward(decode_inputs(batch, self.block_size, seqs, ids, positions, NO_COPIES))
            for seq_id, token in zip(seqs, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[seq_id].append(token)


def _span(tokens: list[int], new: list[int], start: int, end: int) -> list[int]:
    """Positions [start, end) of ``tokens + new`` without copying the whole sequence."""
    length = len(tokens)
    if start >= length:
        return new[start - length : end - length]
    return tokens[start : min(end, length)] + new[: max(0, end - length)]
