"""Turns a scheduler decision into one forward pass: flattened input ids, positions, slot mapping
and block tables; runs the model; samples for every sequence that reached its end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.outputs import TokenLogprob
from engine_svc.sampler import Sampler, SamplingBatch, prompt_logprobs
from engine_svc.scheduler import SchedulerOutput
from engine_svc.sequence import Sequence
from engine_svc.step_inputs import StepInputs
from kernels.backend import Kernels


@dataclass
class SampleResult:
    seq: Sequence
    token_ids: list[int]  # one per sequence of the request: n when an n > 1 prompt completes, else 1
    logprobs: list[TokenLogprob | None]


@dataclass
class StepResult:
    samples: list[SampleResult]
    prompt_logprobs: list[
        tuple[Sequence, int, list[TokenLogprob]]
    ]  # (seq, chunk start, logprobs of next tokens)


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
            torch.tensor(inputs.input_ids, device=dev),
            torch.tensor(inputs.positions, device=dev),
            self.kv_caches,
            inputs.attention(dev),
        )
        if not inputs.logit_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(inputs.logit_rows, device=dev)])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]


class ModelRunner:
    def __init__(self, forward: ModelForward, block_size: int, tp_broadcast=None):
        self.forward = forward
        self.block_size = block_size
        self.tp_broadcast = tp_broadcast  # sends each step's inputs to tensor-parallel workers
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, copies: list[tuple[int, int]]) -> StepResult:
        bs = self.block_size
        inputs = StepInputs([], [], [], [], [], [0], [], copies)
        sample_rows: list[tuple[Sequence, int]] = []  # (seq, how many samples: n when a fork is due)
        plp_rows: list[tuple[Sequence, int, int]] = []  # (seq, chunk start, count) for prompt logprobs
        ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slots
        query_start, seq_lens, tables, logit_rows = (
            inputs.query_start,
            inputs.seq_lens,
            inputs.block_tables,
            inputs.logit_rows,
        )
        start = 0
        for seq, n in out.scheduled:  # the per-step hot loop: plain locals, no properties
            c, table, tokens, request = seq.num_computed_tokens, seq.block_table, seq.token_ids, seq.request
            end = c + n
            if n == 1:
                ids.append(tokens[c])
                positions.append(c)
                slots.append(table[c // bs] * bs + c % bs)
            else:
                ids.extend(tokens[c:end])
                positions.extend(range(c, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(c, end))
            query_start.append(start + n)
            seq_lens.append(end)
            tables.append(table)
            params = request.params
            if end == len(tokens):
                fan = 1 if request.forked or params.n == 1 else params.n
                logit_rows.extend([start + n - 1] * fan)
                sample_rows.append((seq, fan))
            if params.prompt_logprobs is not None and seq.index == 0 and c < request.num_prompt_tokens - 1:
                count = min(end, request.num_prompt_tokens - 1) - c
                plp_rows.append((seq, c, count))
                logit_rows.extend(range(start, start + count))
            start += n
        if self.tp_broadcast is not None:
            self.tp_broadcast(inputs)
        logits = self.forward(inputs)
        num_sampled = sum(k for _, k in sample_rows)
        samples = self._sample(logits[:num_sampled], sample_rows) if sample_rows else []
        plps, at = [], num_sampled
        for seq, c, count in plp_rows:
            next_ids = seq.token_ids[c + 1 : c + 1 + count]
            plps.append(
                (seq, c, prompt_logprobs(logits[at : at + count], next_ids, seq.params.prompt_logprobs))
            )
            at += count
        return StepResult(samples, plps)

    def _sample(self, logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> list[SampleResult]:
        # A prompt of an n > 1 request that completes now samples its n first tokens from one row each.
        row_seqs = [(seq, seq.index if k == 1 else j) for seq, k in rows for j in range(k)]
        tokens, logprobs = self.sampler(logits, self._sampling_batch(row_seqs, logits.device))
        results, r = [], 0
        for seq, k in rows:
            results.append(SampleResult(seq, tokens[r : r + k], logprobs[r : r + k]))
            r += k
        return results

    @staticmethod
    def _sampling_batch(row_seqs: list[tuple[Sequence, int]], device) -> SamplingBatch:
        params = [seq.request.params for seq, _ in row_seqs]
        # One tensor for all the float columns: building seven small tensors costs more than the math.
        cols = torch.tensor(
            [
                (
                    0.0 if p.greedy else p.temperature,
                    p.top_k if p.top_k > 0 else 0,
                    p.top_p,
                    p.min_p,
                    p.repetition_penalty,
                    p.presence_penalty,
                    p.frequency_penalty,
                )
                for p in params
            ],
            dtype=torch.float32,
            device=device,
        ).reshape(len(params), 7)
        any_penalty = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        )
        banned = [
            (list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids)))
            if p.min_tokens and seq.num_output_tokens < p.min_tokens
            else []
            for (seq, _), p in zip(row_seqs, params, strict=True)
        ]
        return SamplingBatch(
            temperature=cols[:, 0],
            top_k=cols[:, 1].to(torch.int64),
            top_p=cols[:, 2],
            min_p=cols[:, 3],
            repetition_penalty=cols[:, 4],
            presence_penalty=cols[:, 5],
            frequency_penalty=cols[:, 6],
            generators=[seq.request.generators[j] if seq.request.generators else None for seq, j in row_seqs],
            output_ids=[seq.output_token_ids for seq, _ in row_seqs] if any_penalty else [[]] * len(params),
            prompt_ids=[seq.request.prompt_token_ids for seq, _ in row_seqs]
            if any_penalty
            else [[]] * len(params),
            banned_ids=banned,
            num_logprobs=[p.logprobs for p in params],
            any_penalty=any_penalty,
            all_greedy=all(p.greedy for p in params),
        )
