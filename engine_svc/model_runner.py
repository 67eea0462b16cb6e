"""Turns a scheduler decision into one forward pass: flattened input ids, positions, slot mapping
and block tables; runs the model; samples for every sequence that reached its end.

Block tables and sampling parameters come from the persistent ``InputBatch`` (gathered by row);
only what changes every step (token ids, positions) is read from the sequences. A step where every
sequence decodes one token takes a short path with no per-sequence branching."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_svc import input_batch as ib
from engine_svc.input_batch import InputBatch
from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.outputs import TokenLogprob
from engine_svc.sampler import Sampler, SamplingBatch, prompt_logprobs
from engine_svc.scheduler import SchedulerOutput
from engine_svc.sequence import Sequence
from engine_svc.step_inputs import StepInputs, to_device
from kernels.backend import Kernels


@dataclass
class StepResult:
    sampled: list[Sequence]  # sequences that reached their end this step, in sampling order
    fans: list[int] | None  # per sampled sequence: n when an n > 1 prompt completes, else 1 (None: all 1)
    token_ids: list[int]  # one per sample row: sequence by sequence, ``fans[i]`` rows each
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[
        tuple[Sequence, int, list[TokenLogprob]]
    ]  # (seq, chunk start, logprobs of next tokens)
    only_decodes: bool  # every scheduled sequence computed one token and is sampled once, in order


class ModelForward:
    """The part every tensor-parallel rank runs: block copies, the forward, the logits."""

    def __init__(
        self, model: DecoderForCausalLM, kernels: Kernels, kv_caches: list[torch.Tensor], device: torch.device
    ):
        self.model = model
        self.kernels = kernels
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.device = device

    @torch.inference_mode()
    def __call__(self, inputs: StepInputs) -> torch.Tensor | None:
        self._copy_blocks(inputs.copies)
        dev = self.device
        hidden = self.model(
            self.kernels,
            to_device(inputs.input_ids, dev),
            to_device(inputs.positions, dev),
            self.kv_caches,
            inputs.attention(dev),
        )
        rows = inputs.logit_rows
        if not len(rows):
            return None
        if len(rows) == len(hidden) and np.array_equal(rows, np.arange(len(rows))):
            return self.model.compute_logits(hidden)  # every token in order (all decodes): no gather
        return self.model.compute_logits(hidden[to_device(rows, dev)])

    def _copy_blocks(self, copies: np.ndarray) -> None:
        if not len(copies):
            return
        src = to_device(np.ascontiguousarray(copies[:, 0]), self.device)
        dst = to_device(np.ascontiguousarray(copies[:, 1]), self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]


class ModelRunner:
    def __init__(self, forward: ModelForward, block_size: int, max_blocks_per_seq: int, tp_broadcast=None):
        self.forward = forward
        self.block_size = block_size
        self.tp_broadcast = tp_broadcast  # sends each step's inputs to tensor-parallel workers
        self.sampler = Sampler()
        self.batch = InputBatch(max_blocks_per_seq)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, copies: list[tuple[int, int]], changed_tables: dict[Sequence, int]
    ) -> StepResult:
        self.batch.sync(changed_tables)
        copy_array = np.array(copies, dtype=np.int64).reshape(len(copies), 2)
        if out.only_decodes:
            return self._execute_decodes(out.seqs, copy_array)
        return self._execute_mixed(out, copy_array)

    def _execute_decodes(self, seqs: list[Sequence], copies: np.ndarray) -> StepResult:
        """Every sequence computes its last token and samples its next one: no ragged lists."""
        bs, count = self.block_size, len(seqs)
        rows = np.array(self.batch.rows(seqs), dtype=np.int64)
        positions = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        input_ids = np.array([s.token_ids[-1] for s in seqs], dtype=np.int64)
        tables = self.batch.gather_tables(rows)
        slots = tables[np.arange(count), positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (positions + 1).astype(np.int32)
        inputs = StepInputs(
            input_ids,
            positions,
            slots,
            tables,
            seq_lens,
            np.arange(count + 1, dtype=np.int32),
            np.arange(count, dtype=np.int64),
            copies,
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
        )
        logits = self._forward(inputs)
        tokens, logprobs = self.sampler(logits, self._sampling_batch(rows, seqs, None, logits.device))
        return StepResult(seqs, None, tokens, logprobs, [], only_decodes=True)

    def _execute_mixed(self, out: SchedulerOutput, copies: np.ndarray) -> StepResult:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        query_start, seq_lens, logit_rows = [0], [], []
        sampled: list[Sequence] = []
        fans: list[int] = []  # per sampled sequence: how many samples (n when a fork is due)
        plp_rows: list[tuple[Sequence, int, int]] = []  # (seq, chunk start, count) for prompt logprobs
        start = 0
        for seq, n in zip(out.seqs, out.num_new, strict=True):
            c, tokens, request = seq.num_computed_tokens, seq.token_ids, seq.request
            end = c + n
            ids.extend(tokens[c:end])
            positions.extend(range(c, end))
            query_start.append(start + n)
            seq_lens.append(end)
            params = request.params
            if end == len(tokens):
                fan = 1 if request.forked or params.n == 1 else params.n
                logit_rows.extend([start + n - 1] * fan)
                sampled.append(seq)
                fans.append(fan)
            if params.prompt_logprobs is not None and seq.index == 0 and c < request.num_prompt_tokens - 1:
                count = min(end, request.num_prompt_tokens - 1) - c
                plp_rows.append((seq, c, count))
                logit_rows.extend(range(start, start + count))
            start += n
        rows = np.array(self.batch.rows(out.seqs), dtype=np.int64)
        num_new = np.array(out.num_new, dtype=np.int64)
        pos = np.array(positions, dtype=np.int64)
        tables = self.batch.gather_tables(rows)
        token_rows = np.repeat(np.arange(len(rows)), num_new)
        slots = tables[token_rows, pos // bs].astype(np.int64) * bs + pos % bs
        inputs = StepInputs(
            np.array(ids, dtype=np.int64),
            pos,
            slots,
            tables,
            np.array(seq_lens, dtype=np.int32),
            np.array(query_start, dtype=np.int32),
            np.array(logit_rows, dtype=np.int64),
            copies,
            max_query_len=int(num_new.max()),
            max_seq_len=max(seq_lens),
        )
        logits = self._forward(inputs)
        num_sampled = sum(fans)
        tokens, logprobs = [], []
        if sampled:
            sample_rows = np.array(self.batch.rows(sampled), dtype=np.int64)
            if num_sampled > len(sampled):
                sample_rows = np.repeat(sample_rows, fans)
            batch = self._sampling_batch(sample_rows, sampled, fans, logits.device)
            tokens, logprobs = self.sampler(logits[:num_sampled], batch)
        plps, at = [], num_sampled
        for seq, c, count in plp_rows:
            next_ids = seq.token_ids[c + 1 : c + 1 + count]
            plps.append(
                (seq, c, prompt_logprobs(logits[at : at + count], next_ids, seq.params.prompt_logprobs))
            )
            at += count
        return StepResult(sampled, fans, tokens, logprobs, plps, only_decodes=False)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.tp_broadcast is not None:
            self.tp_broadcast(inputs)
        return self.forward(inputs)

    def _sampling_batch(
        self, rows: np.ndarray, seqs: list[Sequence], fans: list[int] | None, device
    ) -> SamplingBatch:
        """Sampling parameters of each sample row, gathered from the batch; per-row Python only for
        the features some row uses (seeds, logprobs, penalties, min_tokens)."""
        count = len(rows)
        gathered = self.batch.sampling[rows]
        cols = torch.from_numpy(gathered).to(device)
        used = self.batch.flags[rows].any(axis=0)
        row_seqs = _row_sequences(seqs, fans) if used.any() else []
        generators = [None] * count
        if used[ib.SEEDED]:
            generators = [s.request.generators[j] if s.request.generators else None for s, j in row_seqs]
        num_logprobs = [None] * count
        if used[ib.LOGPROBS]:
            num_logprobs = [s.request.params.logprobs for s, _ in row_seqs]
        output_ids = prompt_ids = banned = [[]] * count
        if used[ib.PENALTY]:
            output_ids = [s.output_token_ids for s, _ in row_seqs]
            prompt_ids = [s.request.prompt_token_ids for s, _ in row_seqs]
        if used[ib.MIN_TOKENS]:
            banned = [_banned_now(s) for s, _ in row_seqs]
        return SamplingBatch(
            temperature=cols[:, ib.TEMPERATURE],
            top_k=cols[:, ib.TOP_K].to(torch.int64),
            top_p=cols[:, ib.TOP_P],
            min_p=cols[:, ib.MIN_P],
            repetition_penalty=cols[:, ib.REPETITION],
            presence_penalty=cols[:, ib.PRESENCE],
            frequency_penalty=cols[:, ib.FREQUENCY],
            generators=generators,
            output_ids=output_ids,
            prompt_ids=prompt_ids,
            banned_ids=banned,
            num_logprobs=num_logprobs,
            any_penalty=bool(used[ib.PENALTY]),
            all_greedy=not gathered[:, ib.TEMPERATURE].any(),
        )


def _row_sequences(seqs: list[Sequence], fans: list[int] | None) -> list[tuple[Sequence, int]]:
    """(sequence, generator index) per sample row: a completing n > 1 prompt samples its n first
    tokens, one from each of its sequences' generators."""
    if fans is None or len(fans) == sum(fans):
        return [(s, s.index) for s in seqs]
    return [(s, s.index if k == 1 else j) for s, k in zip(seqs, fans, strict=True) for j in range(k)]


def _banned_now(seq: Sequence) -> list[int]:
    """Ids that may not be sampled yet: stop tokens (and EOS) before ``min_tokens`` outputs."""
    p = seq.request.params
    if not p.min_tokens or seq.num_output_tokens >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
