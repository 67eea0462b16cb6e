"""Which rows of a step's logits exist, and what each one is for.

The forward pass computes hidden states for every scheduled token; only some of them become logits
rows: the last token of each sequence that reaches its end (it samples; a prompt of an ``n > 1``
request that completes samples ``n`` rows, one per sequence it forks; a sequence verifying ``k``
drafts samples ``k + 1`` rows, one per position), and every prompt token of a request that asked
for prompt logprobs. An embedding request's prompt has no row: it samples nothing. The layout is
built once from the schedule. The model runner writes the rows in this order and the sampler and
the scheduler read them in this order; nobody re-derives it: all sample rows come first, then the
prompt-logprob rows, chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_svc.outputs import TokenLogprob
from engine_svc.sequence import Sequence


@dataclass
class PromptChunk:
    seq: Sequence
    first: int  # position of the first computed token; its row predicts token ``first + 1``
    count: int  # rows: prompt tokens ``first + 1 .. first + count`` get their logprob
    row: int  # the chunk's first row in the logits


@dataclass
class LogitsLayout:
    token_rows: np.ndarray  # per logits row: its token's index in the step's flat batch
    sampled: list[Sequence]  # sequences that sample this step, in row order
    fans: list[int]  # rows per sampled sequence: n when an n > 1 prompt completes, else 1
    num_sample_rows: int  # rows [0, num_sample_rows) are sampled; the rest are prompt-logprob rows
    prompt_chunks: list[PromptChunk]
    # Per sampled sequence: the drafts it verifies this step (its rows are its last token's position
    # and the drafts' positions, in order), or None. None as a whole when nobody drafted.
    drafts: list[list[int] | None] | None = None
    # Embedding requests whose prompt ends this step: they sample nothing (no row); their pooled
    # vector ends them (engine_svc/pooling.py).
    pooled: list[Sequence] = field(default_factory=list)

    @classmethod
    def decodes(cls, seqs: list[Sequence]) -> LogitsLayout:
        """Every sequence computes one token and samples once: row i is token i."""
        n = len(seqs)
        return cls(np.arange(n, dtype=np.int64), seqs, [1] * n, n, [])

    @classmethod
    def build(
        cls, seqs: list[Sequence], num_new: list[int], drafts: dict[Sequence, list[int]] | None = None
    ) -> LogitsLayout:
        sample_rows: list[int] = []
        draft_of: list[list[int] | None] = []
        sampled: list[Sequence] = []
        fans: list[int] = []
        plp_rows: list[int] = []
        chunks: list[tuple[Sequence, int, int, int]] = []  # (seq, first, count, offset among plp rows)
        pooled: list[Sequence] = []
        start = 0  # the sequence's first token in the flat batch
        for seq, n in zip(seqs, num_new, strict=True):
            c, request = seq.num_computed_tokens, seq.request
            end = c + n
            draft = drafts.get(seq) if drafts else None
            if draft is not None:  # the last token and each draft: n rows, n positions
                sample_rows.extend(range(start, start + n))
                sampled.append(seq)
                fans.append(n)
                draft_of.append(draft)
            elif end == len(seq.token_ids) and request.params.pooling is not None:
                pooled.append(seq)  # an embedding: its prompt's hidden states are all it needs
            elif end == len(seq.token_ids):
                fan = 1 if request.forked else request.params.n
                sample_rows.extend([start + n - 1] * fan)
                sampled.append(seq)
                fans.append(fan)
                draft_of.append(None)
            last_prompt = request.num_prompt_tokens - 1
            if request.wants_prompt_logprobs and c < last_prompt:
                count = min(end, last_prompt) - c
                chunks.append((seq, c, count, len(plp_rows)))
                plp_rows.extend(range(start, start + count))
            start += n
        num_sample_rows = len(sample_rows)
        return cls(
            np.array(sample_rows + plp_rows, dtype=np.int64),
            sampled,
            fans,
            num_sample_rows,
            [PromptChunk(s, first, count, num_sample_rows + off) for s, first, count, off in chunks],
            draft_of if drafts else None,
            pooled,
        )


@dataclass
class StepResult:
    """What a forward pass produced, in the rows of the step's ``LogitsLayout``."""

    token_ids: list[int]  # one per sample row
    logprobs: list[TokenLogprob | None]  # one per sample row
    prompt_logprobs: list[list[TokenLogprob]]  # one list per ``layout.prompt_chunks`` entry
    # seq_id -> the proposer's drafts of what follows this step's tokens (``out.propose``'s
    # sequences): the scheduler keeps them on the sequence, and the next step may verify them.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # request id -> an embedding request's pooled vector (float32 bytes), in the step its prompt ends.
    pooled: dict[str, bytes] = field(default_factory=dict)
    # The blocks the step's tier moves read out of the pool (kv_tiers.entry.TierEntry), for the tiers.
    spilled: list = field(default_factory=list)
