"""Turns a scheduler decision into one forward pass: flattened input ids, positions, slot mapping
and block tables; runs the model; samples for every sequence that reached its end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.models.decoder import AttentionInputs, DecoderForCausalLM
from engine_svc.outputs import TokenLogprob
from engine_svc.sampler import Sampler, SamplingBatch, prompt_logprobs
from engine_svc.scheduler import SchedulerOutput
from engine_svc.sequence import Sequence
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
    ]  # (seq, chunk start, logprobs of the next tokens)


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kernels: Kernels,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.kernels = kernels
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[tuple[Sequence, int]] = []  # (seq, flat index of its last token)
        plp_rows: list[tuple[Sequence, int, int]] = []  # (seq, flat start, count) for prompt logprobs
        for seq, n in out.scheduled:
            c = seq.num_computed_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[c : c + n])
            if n == 1:
                positions.append(c)
                slots.append(table[c // bs] * bs + c % bs)
            else:
                span = range(c, c + n)
                positions.extend(span)
                slots.extend(table[p // bs] * bs + p % bs for p in span)
            start = query_start[-1]
            query_start.append(start + n)
            seq_lens.append(c + n)
            tables.append(table)
            if c + n == seq.num_tokens:
                sample_rows.append((seq, start + n - 1))
            num_prompt = seq.request.num_prompt_tokens
            if seq.params.prompt_logprobs is not None and c < num_prompt - 1 and seq.index == 0:
                count = min(c + n, num_prompt - 1) - c
                plp_rows.append((seq, start, count))
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        attn = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(
                [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:], strict=False)),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            self.kernels,
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            self.kv_caches,
            attn,
        )
        return StepResult(
            samples=self._sample(hidden, sample_rows), prompt_logprobs=self._prompt_logprobs(hidden, plp_rows)
        )

    def _sample(self, hidden: torch.Tensor, rows: list[tuple[Sequence, int]]) -> list[SampleResult]:
        if not rows:
            return []
        # A prompt of an n > 1 request that completes now samples its n first tokens from one row.
        fan = [seq.params.n if not seq.request.forked else 1 for seq, _ in rows]
        flat_idx = torch.tensor(
            [i for (_, i), k in zip(rows, fan, strict=True) for _ in range(k)], device=hidden.device
        )
        logits = self.model.compute_logits(hidden[flat_idx])
        row_seqs = [
            (seq, seq.index if k == 1 else j) for (seq, _), k in zip(rows, fan, strict=True) for j in range(k)
        ]
        tokens, logprobs = self.sampler(logits, self._sampling_batch(row_seqs, logits.device))
        results, r = [], 0
        for (seq, _), k in zip(rows, fan, strict=True):
            results.append(SampleResult(seq, tokens[r : r + k], logprobs[r : r + k]))
            r += k
        return results

    def _prompt_logprobs(self, hidden, rows: list[tuple[Sequence, int, int]]):
        out = []
        for seq, start, count in rows:
            c = seq.num_computed_tokens
            logits = self.model.compute_logits(hidden[start : start + count])
            next_ids = seq.token_ids[c + 1 : c + 1 + count]
            out.append((seq, c, prompt_logprobs(logits, next_ids, seq.params.prompt_logprobs)))
        return out

    @staticmethod
    def _sampling_batch(row_seqs: list[tuple[Sequence, int]], device) -> SamplingBatch:
        params = [seq.params for seq, _ in row_seqs]

        def col(name, dtype=torch.float32):
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        any_penalty = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        )
        banned = []
        for seq, _ in row_seqs:
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                banned.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids)))
            else:
                banned.append([])
        return SamplingBatch(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=device),
            top_k=col("top_k", torch.int64).clamp(min=0),
            top_p=col("top_p"),
            min_p=col("min_p"),
            repetition_penalty=col("repetition_penalty"),
            presence_penalty=col("presence_penalty"),
            frequency_penalty=col("frequency_penalty"),
            generators=[seq.request.generators[j] if seq.request.generators else None for seq, j in row_seqs],
            output_ids=[seq.output_token_ids if any_penalty else [] for seq, _ in row_seqs],
            prompt_ids=[seq.request.prompt_token_ids if any_penalty else [] for seq, _ in row_seqs],
            banned_ids=banned,
            num_logprobs=[p.logprobs for p in params],
            any_penalty=any_penalty,
            all_greedy=all(p.greedy for p in params),
        )
