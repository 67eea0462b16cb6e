"""Turns a scheduler decision into one forward pass: flattened input ids, positions, slot mapping
and block tables; runs the model; samples, and computes the prompt logprobs asked for, in the rows
of the step's layout (``SchedulerOutput.rows``); then, with speculative decoding, the proposer
drafts what follows the sampled tokens, and the drafts go back in the step's result for the next
step to verify.

The runner reads the plain-data ``SchedulerOutput`` alone, never the scheduler's ``Sequence``: it
keeps its own record of each sequence by seq id (``runner_state.RequestState``: tokens, counter,
sampling parameters), made from the output's new-request data and advanced by its per-step deltas
(``update_states``, as vLLM v1's ``_update_states``). Block tables and sampling parameters live in
the persistent ``InputBatch`` (gathered by row). A step where every sequence decodes one token
builds its inputs on a short path with no per-sequence branching. A tensor-parallel worker runs the
same ``update_states`` and ``build_inputs`` on the same output (``follow``), so every rank builds
the same inputs."""

from __future__ import annotations

import numpy as np
import torch

from engine_svc import input_batch as ib
from engine_svc.input_batch import InputBatch
from engine_svc.kv_tiers.transfer import run_tier_ops
from engine_svc.logits_layout import StepResult
from engine_svc.logits_processors.processors import default_processors
from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.pooling import PoolingPlan
from engine_svc.runner_state import RequestState, RequestStates
from engine_svc.sampler import Sampler, SamplingBatch, prompt_logprobs
from engine_svc.scheduler_output import SchedulerOutput, StepRows
from engine_svc.sequence import noise_key
from engine_svc.step_inputs import StepInputs, decode_inputs, paged_inputs, to_device
from engine_svc.torch_modes import inference
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

    @inference
    def __call__(
        self, inputs: StepInputs, pool_rows: list[int] | None = None, greedy: bool = False
    ) -> torch.Tensor | None:
        """The step's logits rows; with ``pool_rows`` (rows of the flat batch), their hidden states
        are left in ``self.pooled`` for the embedding requests (engine_svc/pooling.py). With
        ``greedy``, each logits row's argmax instead (``sampler.argmax_rows``' index), which the
        model may find without writing the logits out whole (``greedy_tokens``)."""
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
        if not (len(rows) == len(hidden) and np.array_equal(rows, np.arange(len(rows)))):
            hidden = hidden[to_device(rows, dev)]  # else every token in order (all decodes): no gather
        if greedy:
            return self.model.greedy_tokens(hidden)
        return self.model.compute_logits(hidden)

    @property
    def gives_greedy(self) -> bool:
        """Whether ``greedy=True`` is served by the model's own ``greedy_tokens`` (a stand-in
        model with ``compute_logits`` alone, as benchmarks and tests wrap one, is not asked)."""
        return hasattr(self.model, "greedy_tokens")

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
        lora=None,
        lora_in_use=None,
        kv_groups: int = 1,
    ):
        self.forward = forward
        # A model whose rotary table changes with the sequence's length (long-rope): each token's
        # row of its tables (``DecoderForCausalLM.rotary_rows``) goes in as its position.
        model = getattr(forward, "model", None)
        self.rotary_rows = model.rotary_rows if getattr(model, "rope_switch", None) is not None else None
        self.proposer = proposer  # spec_decode.proposer.Proposer, with speculative decoding
        self.block_size = block_size
        self.tp_broadcast = tp_broadcast  # sends each step's output to tensor-parallel workers
        self.sampler = Sampler()
        # The logit controls, applied by the sampler in this order (engine_svc/logits_processors/).
        self.logits_processors = default_processors()
        self.batch = InputBatch(max_blocks_per_seq, groups=kv_groups)
        self.requests = RequestStates()  # seq id -> its RequestState, while it holds blocks
        # request id -> a "mean" embedding's prompt rows by position (pooling.py), until it ends
        self.pooled_rows: dict[str, torch.Tensor] = {}
        # engine_svc.lora.manager.LoRAManager when LoRA is enabled (a worker: its slots' mirror):
        # ``batch_versions`` makes a step's LoRABatch from its sequences' adapter versions.
        self.lora = lora
        self.lora_in_use = lora_in_use  # () -> {(name, version)} of the adapters running requests use

    def update_states(self, out: SchedulerOutput) -> list[RequestState]:
        """Follow the output: the released sequences go, the new ones come (their tokens, sampling
        parameters and tables), the cached ones advance (tokens appended, counter) and tables
        change where the KV cache changed them. Returns the scheduled sequences' states."""
        states = self.requests.follow(out)
        self.batch.apply(out.updates, out.released, out.new)
        if out.finished_requests and self.pooled_rows:
            for request_id in out.finished_requests:
                self.pooled_rows.pop(request_id, None)
        if self.proposer is not None and (out.forks or out.released):
            self.proposer.follow(out.forks, out.released)  # its per-sequence state, keyed by id
        return states

    @inference
    def execute(self, out: SchedulerOutput) -> StepResult:
        """One forward pass over the schedule; sample and compute prompt logprobs in the rows of
        ``out.rows``, which is the only place that says what each logits row is for; then draft
        (``out.propose``). The runner's state follows the output first, even when nothing is
        scheduled; before that, the moves to and from the prefix cache's lower tiers
        (``out.tier_ops``, in order), whose read-out blocks go back in the result's ``spilled``."""
        spilled = run_tier_ops(self.forward.kv_caches, out.tier_ops) if out.tier_ops else []
        states = self.update_states(out)
        if not out.seq_ids:
            return StepResult([], [], [], spilled=spilled)
        requests = self.requests
        inputs = self.build_inputs(out, states)
        pooling = None if out.only_decodes else PoolingPlan.of(states, out.num_scheduled)
        rows = out.rows
        # Rows that only take their argmax (greedy; no logprobs, logit controls or prompt logprobs
        # read the logits): the model gives the argmax, not the logits (ModelForward's greedy).
        sampling = None
        if rows.sampled and getattr(self.forward, "gives_greedy", False):
            sampling = self._sampling_batch(out, self.forward.device)
        greedy = (
            sampling is not None
            and sampling.all_greedy
            and not sampling.processors
            and not rows.prompt_chunks
            and rows.num_sample_rows == len(inputs.logit_rows)
            and all(n is None for n in sampling.num_logprobs)
        )
        logits = self._forward(out, inputs, pooling.rows if pooling is not None else None, greedy)
        tokens, logprobs = [], []
        if greedy:
            tokens, logprobs = logits.tolist(), [None] * rows.num_sample_rows
        elif rows.sampled:
            head = logits if rows.num_sample_rows == len(logits) else logits[: rows.num_sample_rows]
            tokens, logprobs = self.sampler(head, sampling or self._sampling_batch(out, logits.device))
        plps = []
        for c in rows.prompt_chunks:
            state = requests[c.seq_id]
            plps.append(
                prompt_logprobs(
                    logits[c.row : c.row + c.count],
                    state.token_ids[c.first + 1 : c.first + 1 + c.count],
                    state.params.prompt_logprobs,
                )
            )
        result = StepResult(tokens, logprobs, plps, spilled=spilled)
        if pooling is not None:
            result.pooled = pooling.finish(self.forward.pooled, self.pooled_rows)
            self.forward.pooled = None
        if self.proposer is not None:  # after sampling: what follows the tokens just sampled
            result.drafts = self.proposer.propose(out, tokens, requests, self.batch)
        return result

    @inference
    def follow(self, out: SchedulerOutput) -> None:
        """A tensor-parallel worker's step: follow the output as rank 0 does and run the same
        forward (rank 0 samples)."""
        states = self.update_states(out)
        if out.seq_ids:
            self.forward(self.build_inputs(out, states))

    def build_inputs(self, out: SchedulerOutput, states: list[RequestState]) -> StepInputs:
        if out.only_decodes:
            inputs = self.decode_inputs(out, states)
        else:
            inputs = self.general_inputs(out, states)
        if self.rotary_rows is not None:  # long-rope: each token's table by its sequence's length
            lengths = np.repeat([len(s.token_ids) for s in states], np.diff(inputs.query_start))
            inputs.positions = self.rotary_rows(inputs.positions, lengths)
        if self.lora is not None and self.lora.adapters:
            num_new = None if out.only_decodes else out.num_scheduled
            in_use = self.lora_in_use() if self.lora_in_use is not None else set()
            inputs.lora = self.lora.batch_versions([s.lora for s in states], num_new, in_use)
        return inputs

    def decode_inputs(self, out: SchedulerOutput, states: list[RequestState]) -> StepInputs:
        """The short path, for a step where every sequence computes its last token and samples its
        next one: no ragged lists. ``tests/test_step_contract.py`` proves it equal to the general one."""
        # The counters as the output sent them, when it sent every sequence's (none new), and in
        # the steady state the last tokens too: the one token each was just sent.
        cached = out.cached
        if cached.seq_ids is out.seq_ids or cached.seq_ids == out.seq_ids:
            computed = cached.num_computed_tokens
            last = cached.one_each if cached.one_each is not None else [s.token_ids[-1] for s in states]
        else:
            computed = [s.num_computed_tokens for s in states]
            last = [s.token_ids[-1] for s in states]
        positions = np.array(computed, dtype=np.int64)
        input_ids = np.array(last, dtype=np.int64)
        return decode_inputs(self.batch, self.block_size, out.seq_ids, input_ids, positions, out.copies)

    def general_inputs(self, out: SchedulerOutput, states: list[RequestState]) -> StepInputs:
        ids: list[int] = []
        starts = []
        drafts = out.drafts
        for state, n in zip(states, out.num_scheduled, strict=True):
            c = state.num_computed_tokens
            ids.extend(state.token_ids[c : c + n])
            if drafts and state.seq_id in drafts:
                ids.extend(drafts[state.seq_id])  # verified in this step: positions after the last token
            starts.append(c)
        return paged_inputs(
            self.batch,
            self.block_size,
            out.seq_ids,
            np.array(ids, dtype=np.int64),
            np.array(starts, dtype=np.int64),
            np.array(out.num_scheduled, dtype=np.int64),
            out.rows.token_rows,
            out.copies,
        )

    def _forward(
        self, out: SchedulerOutput, inputs: StepInputs, pool_rows=None, greedy: bool = False
    ) -> torch.Tensor:
        if self.tp_broadcast is not None:
            self.tp_broadcast(out)  # every worker builds these inputs from it
        if greedy:
            return self.forward(inputs, pool_rows, greedy=True)
        if pool_rows is None:
            return self.forward(inputs)
        return self.forward(inputs, pool_rows)

    def _sampling_batch(self, out: SchedulerOutput, device) -> SamplingBatch:
        """Sampling parameters of each sample row, gathered from the batch; per-row Python only for
        the features some row uses (seeds, logprobs, and each logit control's ``prepare``)."""
        layout = out.rows
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
            row_states = _row_states(layout, self.requests)
            if used[ib.SEEDED]:
                noise_keys = [
                    None if s.params.seed is None else noise_key(s.params.seed, j, len(s.token_ids) + k)
                    for s, j, k in row_states
                ]
            if used[ib.LOGPROBS]:
                num_logprobs = [s.params.logprobs for s, *_ in row_states]
            for processor in self.logits_processors:
                if used[processor.flag]:
                    state = processor.prepare(row_states, out)
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


def _row_states(layout: StepRows, requests: RequestStates) -> list[tuple[RequestState, int, int]]:
    """(its sequence's state, index of the noise it draws, position offset) per sample row: a
    completing n > 1 prompt samples its n first tokens, one for each of its sequences; a sequence
    verifying drafts samples one row per position after its last token."""
    sampled = [requests[i] for i in layout.sampled]
    if len(sampled) == layout.num_sample_rows:
        return [(s, s.index, 0) for s in sampled]
    drafts = layout.drafts or [None] * len(sampled)
    rows = []
    for s, k, draft in zip(sampled, layout.fans, drafts, strict=True):
        if draft is not None:
            rows += [(s, s.index, j) for j in range(k)]
        else:
            rows += [(s, s.index if k == 1 else j, 0) for j in range(k)]
    return rows
