"""Turns a scheduler decision into one forward pass: flattened input ids, positions, slot mapping
and block tables; runs the model; samples, and computes the prompt logprobs asked for, in the rows
of the step's ``LogitsLayout``; then, with speculative decoding, the proposer drafts what follows
the sampled tokens, and the drafts go back in the step's result for the next step to verify.

Block tables and sampling parameters come from the persistent ``InputBatch`` (gathered by row);
only what changes every step (token ids, positions) is read from the sequences. A step where every
sequence decodes one token builds its inputs on a short path with no per-sequence branching."""

from __future__ import annotations

import numpy as np
import torch

from engine_svc import input_batch as ib
from engine_svc.input_batch import InputBatch
from engine_svc.kv_tiers.transfer import run_tier_ops
from engine_svc.logits_layout import LogitsLayout, StepResult
from engine_svc.logits_processors.processors import default_processors
from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.pooling import PoolingPlan
from engine_svc.sampler import Sampler, SamplingBatch, prompt_logprobs
from engine_svc.scheduler_output import SchedulerOutput
from engine_svc.sequence import Sequence, noise_key
from engine_svc.step_inputs import StepInputs, decode_inputs, paged_inputs, to_device
from kernels.backend import Kernels


class ModelForward:
    """The part every tensor-parallel rank runs: block copies, the forward, the logits."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kernels: Kernels,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        lora_step=None,
    ):
        self.model = model
        self.lora_step = lora_step  # engine_svc.lora.layers.LoRAStep when the model's layers are wrapped
        self.kernels = kernels
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        self.device = device
        self.pooled: torch.Tensor | None = None  # the hidden rows a step's embedding requests asked for

    @torch.inference_mode()
    def __call__(self, inputs: StepInputs, pool_rows: list[int] | None = None) -> torch.Tensor | None:
        """The step's logits rows; with ``pool_rows`` (rows of the flat batch), their hidden states
        are left in ``self.pooled`` for the embedding requests (engine_svc/pooling.py)."""
        self.copy_blocks(inputs.copies)
        dev = self.device
        if self.lora_step is not None:  # the wrapped projections read the step's adapter mapping
            self.lora_step.batch = inputs.lora
        try:
            hidden = self.model(
                self.kernels,
                to_device(inputs.input_ids, dev),
                to_device(inputs.positions, dev),
                self.kv_caches,
                inputs.attention(dev),
            )
        finally:
            if self.lora_step is not None:
                self.lora_step.batch = None
        if pool_rows is not None:
            self.pooled = hidden[to_device(np.array(pool_rows, dtype=np.int64), dev)]
        rows = inputs.logit_rows
        if not len(rows):
            return None
        if len(rows) == len(hidden) and np.array_equal(rows, np.arange(len(rows))):
            return self.model.compute_logits(hidden)  # every token in order (all decodes): no gather
        return self.model.compute_logits(hidden[to_device(rows, dev)])

    def copy_blocks(self, copies: np.ndarray) -> None:
        if not len(copies):
            return
        src = to_device(np.ascontiguousarray(copies[:, 0]), self.device)
        dst = to_device(np.ascontiguousarray(copies[:, 1]), self.device)
        # A page's layers in every cache tensor (layers of several KV cache groups share one).
        for cache in {id(c): c for c in self.kv_caches}.values():
            cache[:, dst] = cache[:, src]


class ModelRunner:
    def __init__(
        self,
        forward: ModelForward,
        block_size: int,
        max_blocks_per_seq: int,
        tp_broadcast=None,
        proposer=None,
        grammar_executor=None,
        lora=None,
        lora_in_use=None,
        kv_groups: int = 1,
    ):
        self.forward = forward
        self.proposer = proposer  # spec_decode.proposer.Proposer, with speculative decoding
        self.block_size = block_size
        self.tp_broadcast = tp_broadcast  # sends each step's inputs to tensor-parallel workers
        self.sampler = Sampler()
        # The logit controls, applied by the sampler in this order (engine_svc/logits_processors/).
        self.logits_processors = default_processors(grammar_executor)
        self.batch = InputBatch(max_blocks_per_seq, groups=kv_groups)
        self.lora = lora  # engine_svc.lora.manager.LoRAManager, when LoRA is enabled
        self.lora_in_use = lora_in_use  # () -> {(name, version)} of the adapters running requests use

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """One forward pass over the schedule; sample and compute prompt logprobs in the rows of
        ``out.layout``, which is the only place that says what each logits row is for; then draft
        (``out.propose``). The input batch follows the KV changes ``out`` carries first, even when
        nothing is scheduled; before that, the moves to and from the prefix cache's lower tiers
        (``out.tier_ops``, in order), whose read-out blocks go back in the result's ``spilled``."""
        spilled = run_tier_ops(self.forward.kv_caches, out.tier_ops) if out.tier_ops else []
        self.batch.apply(out.updates, out.released)
        if self.proposer is not None and (out.forks or out.released):
            self.proposer.follow(out.forks, out.released)  # its per-sequence state, keyed by id
        if not out.seqs:
            return StepResult([], [], [], spilled=spilled)
        inputs = self.build_inputs(out)
        pooling = None if out.only_decodes else PoolingPlan.of(out.seqs, out.num_new)
        logits = self._forward(inputs, pooling.rows if pooling is not None else None)
        layout = out.layout
        tokens, logprobs = [], []
        if layout.sampled:
            head = logits if layout.num_sample_rows == len(logits) else logits[: layout.num_sample_rows]
            tokens, logprobs = self.sampler(head, self._sampling_batch(layout, logits.device))
        plps = [
            prompt_logprobs(
                logits[c.row : c.row + c.count],
                c.seq.token_ids[c.first + 1 : c.first + 1 + c.count],
                c.seq.params.prompt_logprobs,
            )
            for c in layout.prompt_chunks
        ]
        result = StepResult(tokens, logprobs, plps, spilled=spilled)
        if pooling is not None:
            result.pooled = pooling.finish(self.forward.pooled)
            self.forward.pooled = None
        if self.proposer is not None:  # after sampling: what follows the tokens just sampled
            result.drafts = self.proposer.propose(out, tokens, self.batch)
        return result

    def build_inputs(self, out: SchedulerOutput) -> StepInputs:
        if out.only_decodes:
            inputs = self.decode_inputs(out.seqs, out.copies)
        else:
            inputs = self.general_inputs(out, out.copies)
        if self.lora is not None and self.lora.adapters:
            adapters = [s.request.lora for s in out.seqs]
            num_new = None if out.only_decodes else out.num_new
            inputs.lora = self.lora.batch(adapters, num_new, self.lora_in_use())
        return inputs

    def decode_inputs(self, seqs: list[Sequence], copies: np.ndarray) -> StepInputs:
        """The short path, for a step where every sequence computes its last token and samples its
        next one: no ragged lists. ``tests/test_step_contract.py`` proves it equal to the general one."""
        positions = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        input_ids = np.array([s.token_ids[-1] for s in seqs], dtype=np.int64)
        return decode_inputs(self.batch, self.block_size, seqs, input_ids, positions, copies)

    def general_inputs(self, out: SchedulerOutput, copies: np.ndarray) -> StepInputs:
        ids: list[int] = []
        starts = []
        drafts = out.drafts
        for seq, n in zip(out.seqs, out.num_new, strict=True):
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c : c + n])
            if drafts and seq in drafts:
                ids.extend(drafts[seq])  # verified in this step: positions after the last token
            starts.append(c)
        return paged_inputs(
            self.batch,
            self.block_size,
            out.seqs,
            np.array(ids, dtype=np.int64),
            np.array(starts, dtype=np.int64),
            np.array(out.num_new, dtype=np.int64),
            out.layout.token_rows,
            copies,
        )

    def _forward(self, inputs: StepInputs, pool_rows: list[int] | None = None) -> torch.Tensor:
        if self.tp_broadcast is not None:
            self.tp_broadcast(inputs)
        if pool_rows is None:
            return self.forward(inputs)
        return self.forward(inputs, pool_rows)

    def _sampling_batch(self, layout: LogitsLayout, device) -> SamplingBatch:
        """Sampling parameters of each sample row, gathered from the batch; per-row Python only for
        the features some row uses (seeds, logprobs, and each logit control's ``prepare``)."""
        rows = np.array(self.batch.rows(layout.sampled), dtype=np.int64)
        if len(rows) < layout.num_sample_rows:
            rows = np.repeat(rows, layout.fans)
        count = len(rows)
        gathered = self.batch.sampling[rows]
        # One op for the seven columns (views), not one each: at batch 1 every torch op between two
        # forwards costs microseconds, the caches being cold from the weights streamed through.
        cols = torch.from_numpy(gathered).to(device).unbind(1)
        used = self.batch.flags[rows].any(axis=0)
        noise_keys = [None] * count
        num_logprobs = [None] * count
        processors = []
        if used.any():
            row_seqs = _row_sequences(layout)
            if used[ib.SEEDED]:
                noise_keys = [
                    None
                    if s.request.params.seed is None
                    else noise_key(s.request.params.seed, j, len(s.token_ids) + k)
                    for s, j, k in row_seqs
                ]
            if used[ib.LOGPROBS]:
                num_logprobs = [s.request.params.logprobs for s, *_ in row_seqs]
            for processor in self.logits_processors:
                if used[processor.flag]:
                    state = processor.prepare(row_seqs, layout)
                    if state is not None:
                        processors.append((processor, state))
        return SamplingBatch(
            temperature=cols[ib.TEMPERATURE],
            top_k=cols[ib.TOP_K].to(torch.int64),
            top_p=cols[ib.TOP_P],
            min_p=cols[ib.MIN_P],
            repetition_penalty=cols[ib.REPETITION],
            presence_penalty=cols[ib.PRESENCE],
            frequency_penalty=cols[ib.FREQUENCY],
            noise_keys=noise_keys,
            num_logprobs=num_logprobs,
            all_greedy=not gathered[:, ib.TEMPERATURE].any(),
            processors=processors,
        )


def _row_sequences(layout: LogitsLayout) -> list[tuple[Sequence, int, int]]:
    """(sequence, index of the noise it draws, position offset) per sample row: a completing n > 1
    prompt samples its n first tokens, one for each of its sequences; a sequence verifying drafts
    samples one row per position after its last token."""
    if len(layout.sampled) == layout.num_sample_rows:
        return [(s, s.index, 0) for s in layout.sampled]
    drafts = layout.drafts or [None] * len(layout.sampled)
    rows = []
    for s, k, draft in zip(layout.sampled, layout.fans, drafts, strict=True):
        if draft is not None:
            rows += [(s, s.index, j) for j in range(k)]
        else:
            rows += [(s, s.index if k == 1 else j, 0) for j in range(k)]
    return rows
