"""The step-level engine the server drives: add / abort requests, and ``step()`` runs one
schedule -> forward -> sample -> emit cycle over every running request."""

from __future__ import annotations

import itertools
import logging
import time
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine_svc.config import CPU_MIN_SEQS_PER_STEP, CPU_SEQS_PER_STEP_PER_THREAD, EngineConfig, ModelInfo
from engine_svc.gc_freeze import freeze_startup_heap, return_freed_memory
from engine_svc.grammar_compiler import GrammarCompiler, find_tokenizer_json
from engine_svc.kv_budget import available_memory, cpu_default_kv_bytes, replicas_sharing
from engine_svc.kv_cache_manager import KVCacheManager, cdiv
from engine_svc.kv_groups import layout_of
from engine_svc.kv_tiers.setup import build_tiers
from engine_svc.kv_tiers.store import TierStats
from engine_svc.kv_tiers.transfer import run_tier_ops
from engine_svc.lora.adapter import AdapterError, LoRAAdapter
from engine_svc.lora.manager import AdapterInUse, AdapterNotFound, LoRAManager
from engine_svc.model_runner import ModelRunner
from engine_svc.models.arch import refuse_untested
from engine_svc.models.spec import ModelSpec
from engine_svc.outputs import RequestDelta
from engine_svc.parallel.group import TensorParallelGroup
from engine_svc.parallel.shard import Shard
from engine_svc.rank_runtime import RankRuntime, resolve_max_model_len
from engine_svc.request_limits import (
    RequestLimits,
    Violation,
    prompt_violations,
    raise_if_any,
    token_id_violations,
)
from engine_svc.sampling_params import SamplingParams
from engine_svc.scheduler import Scheduler
from engine_svc.sequence import Request, Sequence
from engine_svc.spec_decode.config import SpeculativeConfig
from engine_svc.spec_decode.draft_model import DraftModelProposer
from engine_svc.spec_decode.proposer import NgramProposer, Proposer
from engine_svc.step_cost import DECODE_STALL_FACTOR, STEP_FLOOR, ratio_for_spec

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified since the engine started
    num_accepted_draft_tokens: int = 0  # ... and accepted

    @property
    def draft_acceptance(self) -> float | None:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    # Cumulative: prompt tokens the engine computed (cache hits excluded) and tokens it generated.
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    running_lora_adapters: tuple[str, ...] = ()  # names, as vLLM's lora_requests_info labels them
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0  # device slots; 0: LoRA off
    # The prefix cache's tiers below the pool (host, disk), each its own figures (kv_tiers/store.py).
    kv_tiers: tuple[TierStats, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.spec = ModelSpec.from_path(config.model)
        refuse_untested(  # the engine features not tested on this architecture refuse it here
            self.spec.arch,
            {
                "lora": config.enable_lora or bool(config.lora_modules),
                "speculative": config.speculative_config is not None,
                "tensor_parallel": config.tensor_parallel_size > 1,
            },
        )
        self.max_model_len = resolve_max_model_len(self.spec, config)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step's budget (in the engine's own copy:
            # the caller's config is left as it was given).
            config = replace(config, max_num_batched_tokens=self.max_model_len)
        self.config = config
        # Rank 0: the model, its kernels, KV cache and forward (each worker builds its rank alike).
        self.runtime = RankRuntime(config, 0, spec=self.spec, max_model_len=self.max_model_len)
        shard, self.device, self.dtype = self.runtime.shard, self.runtime.device, self.runtime.dtype
        self.model = self.runtime.model
        self.act_dtype = self.runtime.activation_dtype  # fp32 under bf16 weights on the native CPU GEMM
        self.kv_dtype = self.runtime.kv_cache_dtype  # the activations' unless kv_cache_dtype says
        self.kernels = self.runtime.kernels
        self.speculative = SpeculativeConfig.parse(config.speculative_config)  # parsed here, once
        self.draft_spec = self._draft_spec()
        num_blocks = self._num_kv_blocks(shard)
        kv_caches = self.runtime.allocate_kv_caches(num_blocks)
        self.tp_group = TensorParallelGroup(config, num_blocks, self.device) if shard.size > 1 else None
        self.kv_layout = layout_of(self.spec)
        windows = tuple(g.window for g in self.kv_layout.groups)
        why_not = None
        if shard.size > 1:
            why_not = "tensor parallelism (each rank would spill its own shard)"
        elif self.draft_spec is not None:
            why_not = "a draft model (its KV cache would have to move with the target's)"
        self.kv_tiers = build_tiers(
            config, self.device, kv_caches, windows, self.kv_dtype, self.dtype, self.kernels.name, why_not
        )
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            windows,
            self.kv_tiers,
            self.spec.rope_switch,
        )
        ratio = config.attention_work_ratio
        ratio = ratio_for_spec(self.spec) if ratio is None else ratio
        seats = seqs_per_step(config, self.device)
        stall = config.decode_stall_factor
        stall = DECODE_STALL_FACTOR.get(self.device.type, 0.0) if stall is None else stall
        floor = STEP_FLOOR.get(self.device.type, STEP_FLOOR["cpu"])
        self.grammars = self._grammar_compiler()
        self.scheduler = Scheduler(
            config,
            self.kv,
            self.speculative,
            ratio,
            seats,
            (stall, floor),
            vocab_size=self.spec.vocab_size,
            grammar_executor=self.grammars.executor if self.grammars is not None else None,
            measure_floor=True,
        )
        self.lora = None
        if config.enable_lora:
            self.lora = LoRAManager(
                self.spec,
                config.max_loras,
                config.max_lora_rank,
                self.act_dtype,
                self.device,
                self.kernels.lora_apply,
                shard,
            )
            if self.tp_group is not None:  # workers load each adapter into the same slot, their part
                self.lora.slots.on_load = self.tp_group.send_lora_load
            self.runtime.wrap_lora()  # the model's projections carry the adapters
        forward = self.runtime.forward()
        self.runner = ModelRunner(
            forward,
            config.block_size,
            cdiv(self.max_model_len, config.block_size),
            self.tp_group.broadcast if self.tp_group else None,
            proposer=self._proposer(num_blocks),
            lora=self.lora,
            lora_in_use=self.scheduler.running_adapters if self.lora is not None else None,
            kv_groups=len(self.kv_layout.groups),
        )
        for name, path in (config.lora_modules or {}).items():
            self.lora.load(name, path)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        self.model_info = ModelInfo(
            model_name=Path(config.model).name,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(self.spec.eos_token_ids),
            block_size=config.block_size,
            num_kv_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_logprobs=config.max_logprobs,
            architectures=[self.spec.architecture],
        )
        freeze_startup_heap()
        return_freed_memory()
        log.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d, tp %d, "
            "%d running sequences, %d a step",
            self.spec.architecture,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
            self.max_model_len,
            shard.size,
            config.max_num_seqs,
            seats,
        )

    def _draft_spec(self) -> ModelSpec | None:
        """The draft model's facts, refused unless it can draft for this target."""
        spec_config = self.speculative
        if spec_config is None or spec_config.method != "draft_model":
            return None
        where = f"speculative_config.model ({spec_config.model})"
        if self.config.tensor_parallel_size > 1:
            raise ValueError("speculative_config: method 'draft_model' runs with tensor_parallel_size 1 only")
        try:
            draft = ModelSpec.from_path(spec_config.model)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{where}: not a loadable model directory: {e}") from None
        if draft.vocab_size != self.spec.vocab_size:
            raise ValueError(
                f"{where}: the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
                f"{self.spec.vocab_size}; a draft model must share the target's vocabulary"
            )
        if draft.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"{where}: the draft model's context ({draft.max_position_embeddings}) is shorter than "
                f"max_model_len ({self.max_model_len})"
            )
        return draft

    def _proposer(self, num_blocks: int) -> Proposer | None:
        """What drafts after each step: n-gram lookup, or the draft model and its KV cache (the
        target's blocks, in tensors of its own shape)."""
        if self.speculative is None:
            return None
        if self.draft_spec is None:
            return NgramProposer(self.speculative)
        c = self.config
        draft_config = replace(c, model=self.speculative.model, speculative_config=None)
        # A rank of its own (tensor_parallel_size is 1 with a draft model), on the target's context
        # and kernels, leaving torch's RNG where the target's load left it.
        draft = RankRuntime(
            draft_config,
            0,
            spec=self.draft_spec,
            max_model_len=self.max_model_len,
            seed=False,
            kernels=self.kernels,
        )
        draft.allocate_kv_caches(num_blocks)
        log.info("draft model %s: %d layers", self.speculative.model, self.draft_spec.num_layers)
        return DraftModelProposer(draft.forward(), c.block_size)

    def _grammar_compiler(self) -> GrammarCompiler | None:
        tokenizer_json = find_tokenizer_json(self.config.model)
        if tokenizer_json is None:
            return None  # token-only model directory: structured outputs are refused
        if not self.spec.eos_token_ids:  # a grammar has no way to end: structured outputs are refused
            log.warning("the model names no end-of-sequence token (eos_token_id): no structured outputs")
            return None
        return GrammarCompiler(tokenizer_json, self.spec.vocab_size, list(self.spec.eos_token_ids))

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and the grammar compiler's thread."""
        if self.kv_tiers is not None:
            self.flush_tiers()
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.tp_group is not None:
            self.tp_group.close()
            self.tp_group = None

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
        client: str = "",
    ) -> None:
        """Validate and queue a request; ``ValueError`` (naming the field and limit) leaves no trace.
        ``lora`` names a loaded adapter (None or "": the base model); an unknown one raises
        ``AdapterNotFound`` (a LookupError). ``client`` says who sent it: when more requests run
        than a step computes, the step's seats go round the clients (scheduler.py)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        adapter = self._adapter(lora) if lora else None
        prompt = list(prompt_token_ids)
        # The rules every door shares (engine_svc/request_limits.py): the gateway has checked them
        # already; a caller of this API (the offline LLM, a test) meets them here.
        limits = RequestLimits(
            self.spec.vocab_size,
            self.max_model_len,
            self.config.max_logprobs,
            block_size=self.config.block_size,
            num_kv_blocks=self.kv.num_blocks,
            kv_pages=self._kv_pages if self.kv_layout.windowed else None,
            eos_token_ids=tuple(self.spec.eos_token_ids),
        )
        v = token_id_violations(prompt, "prompt_token_ids", limits.vocab_size, first_only=True)
        v += params.violations(limits)
        if isinstance(priority, bool) or not isinstance(priority, int):
            v.append(Violation("priority", f"must be an integer, got {priority!r}"))
        raise_if_any(v or prompt_violations(len(prompt), params.max_tokens, limits, "prompt_token_ids"))
        max_tokens = self.max_model_len - len(prompt) if params.max_tokens is None else params.max_tokens
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None and not self.spec.eos_token_ids:
                raise ValueError(
                    "structured_outputs needs the model's end-of-sequence token: neither config.json / "
                    "generation_config.json (eos_token_id) nor tokenizer_config.json (eos_token) names one"
                )
            if self.grammars is None:
                raise ValueError("structured_outputs needs the model directory's tokenizer.json (none here)")
            grammar = params.structured_outputs.to_grammar()  # ValueError naming the field
        params = replace(params, eos_token_ids=tuple(self.spec.eos_token_ids))  # the caller's stays as it was
        arrival = next(self._arrivals)
        if params.pooling == "mean":  # every prompt row is needed: no prefix hit (engine_svc/pooling.py)
            cache_salt = f"{cache_salt or ''}\x00mean-pooling\x00{arrival}"
        request = Request(request_id, prompt, params, priority, cache_salt, arrival, max_tokens)
        request.lora = adapter
        request.client = client
        if grammar is not None:
            request.grammar = self.grammars.submit(grammar)  # compiled off the loop; admitted when ready
        seq = Sequence(request, 0, list(prompt))
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    # --- LoRA adapters --------------------------------------------------------------------------
    def _adapter(self, name: str) -> LoRAAdapter:
        if self.lora is None:
            raise AdapterNotFound(f"no LoRA adapter named {name!r}: LoRA is not enabled (--enable-lora)")
        return self.lora.get(name)

    def add_lora(self, name: str, path: str, int_id: int | None = None) -> LoRAAdapter:
        """Load (or reload) adapter ``name`` from a PEFT directory. ``ValueError`` naming the problem
        (missing file, bad config, rank above the limit, a module or shape the model lacks) changes
        nothing."""
        return self.install_lora(self.read_lora(name, path, int_id))

    def read_lora(self, name: str, path: str, int_id: int | None = None) -> LoRAAdapter:
        """``add_lora``'s file work alone (no engine state is touched): a server runs it off its loop."""
        if self.lora is None:
            raise AdapterError("LoRA is not enabled: start the engine with enable_lora (--enable-lora)")
        return self.lora.read(name, path, int_id)

    def install_lora(self, adapter: LoRAAdapter) -> LoRAAdapter:
        return self.lora.install(adapter)

    def remove_lora(self, name: str) -> None:
        """Unload ``name``: ``AdapterNotFound`` if it is not loaded, ``ValueError`` while live
        requests use it (they keep their adapter to the end; unload after)."""
        self._adapter(name)
        users = sum(1 for r in self.requests.values() if r.lora is not None and r.lora.name == name)
        if users:
            raise AdapterInUse(
                f"adapter {name!r} is in use by {users} live request(s); unload it after they end"
            )
        self.lora.unload(name)

    def list_loras(self) -> list[LoRAAdapter]:
        return [] if self.lora is None else list(self.lora.adapters.values())

    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Drop a request (or, with ``index``, one of its n outputs) now, returning its blocks as soon
        as nothing else needs them. Emits no delta. False when nothing live matched."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        indexes = set(range(request.params.n)) if index is None else {index}
        indexes -= request.ended
        if not indexes:
            return False
        self.scheduler.abort(request, indexes)
        if request.finished:
            del self.requests[request_id]
        if self.kv_tiers is not None and not self.requests:
            self.flush_tiers()  # the blocks it computed: on disk now, not at the next step
        return True

    def request_finished(self, request_id: str) -> bool:
        """True once every output of the request has ended (or it was never here)."""
        return request_id not in self.requests

    def pause_request(self, request_id: str) -> bool:
        """Stop stepping a request (its reader is not keeping up); it keeps its place and its blocks,
        which it gives up first when the pool runs dry. False if no such live request."""
        return self._set_paused(request_id, True)

    def resume_request(self, request_id: str) -> bool:
        return self._set_paused(request_id, False)

    def _set_paused(self, request_id: str, paused: bool) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.set_paused(request, paused)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def compiling_grammars(self) -> bool:
        """Some request waits for its grammar (compiled off the loop): a step may soon run it."""
        return bool(self._compiling())

    def _compiling(self) -> list:
        return [r.grammar for r in self.requests.values() if r.waiting_for_grammar]

    # --- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """schedule -> forward and sample -> the scheduler applies the result; nothing else. The
        scheduler's output carries everything the runner needs (the KV changes included)."""
        out = self.scheduler.schedule()
        deltas = out.failed
        if out.seqs and not out.only_decodes:  # prompt tokens this step computes (a decode is not one)
            self.num_prompt_tokens_computed += sum(
                min(n, s.request.num_prompt_tokens - s.num_computed_tokens)
                for s, n in zip(out.seqs, out.num_new, strict=True)
                if s.num_computed_tokens < s.request.num_prompt_tokens
            )
        started = time.perf_counter()
        # The runner reads the plain-data output alone (with nothing scheduled, it only follows it).
        result = self.runner.execute(out.output)
        self.scheduler.store_spilled(
            result
        )  # evicted blocks, read out before the forward: to the lower tiers
        if out.seqs:
            self.num_steps += 1
            stepped = self.scheduler.update_from_output(out, result)
            self.scheduler.note_step_time(out, time.perf_counter() - started, stepped)
            deltas += stepped
            self.num_generation_tokens += sum([len(d.new_token_ids) for d in stepped])
        else:
            compiling = self._compiling()
            if compiling:  # nothing else can run: wait for a grammar rather than spin against it
                futures.wait(compiling, timeout=0.01, return_when=futures.FIRST_COMPLETED)
        for delta in deltas:
            if delta.request_finished:
                del self.requests[delta.request_id]
        if self.kv_tiers is not None and not self.requests:
            self.flush_tiers()
        return deltas

    def flush_tiers(self) -> None:
        """Write the blocks computed since the last step down to the tiers now (the next step
        would; an idle engine takes none)."""
        ops = self.kv.take_tier_ops()
        if ops:
            self.kv.store_spilled(run_tier_ops(self.runner.forward.kv_caches, ops))

    # --- facts --------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        running_loras = waiting_loras = ()
        if self.lora is not None:
            running_loras = _adapter_names(self.scheduler.running)
            waiting_loras = _adapter_names(self.scheduler.waiting)
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.num_used,
            kv_blocks_total=self.kv.num_blocks,
            prefix_queried_tokens=self.kv.queried_tokens,
            prefix_hit_tokens=self.kv.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_draft_tokens=self.scheduler.num_drafted,
            num_accepted_draft_tokens=self.scheduler.num_accepted,
            prompt_tokens_computed=self.num_prompt_tokens_computed,
            generation_tokens=self.num_generation_tokens,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            max_lora=self.config.max_loras if self.lora is not None else 0,
            kv_tiers=tuple(replace(t) for t in self.kv_tiers.stats()) if self.kv_tiers is not None else (),
        )

    # --- KV-cache events (for KV-aware routers) ---------------------------------------------------
    def listen_kv_events(self) -> list:
        """Start logging prefix-cache events; returns the snapshot of the cache as events."""
        return self.kv.pool.listen(self.kv.block_size)

    def stop_kv_events(self) -> None:
        self.kv.pool.stop_listening()

    def take_kv_events(self) -> list:
        """The events since the last take (empty when nobody listens)."""
        log = self.kv.pool.events
        return log.take() if log is not None and log.events else []

    def cached_block_hashes(self) -> set[int]:
        """The prefix cache's block hashes, read from the pool itself (tests compare a router's
        replay of the events against this)."""
        return set(self.kv.pool.cached)

    def check_invariants(self) -> None:
        """The pool is whole: every reference is held by a live sequence, and vice versa; a running
        sequence holds no block past its tokens; the input batch mirrors the block tables, up to
        the changes the next step carries, and the proposer keeps state for live sequences only. It
        only reads: nothing it checks is consumed."""
        for rid, request in self.requests.items():
            assert not request.finished, f"request {rid} has ended but is still held"
        live = [s for r in self.requests.values() for s in r.sequences if s.finish_reason is None]
        self.scheduler.check_invariants()
        queued = set(map(id, self.scheduler.running)) | set(map(id, self.scheduler.waiting))
        assert queued == set(map(id, live)), (
            "a live sequence is missing from the queues, or a dead one is in them"
        )
        # The input batch as of the last step: a sequence with changes pending (the next step
        # carries them) may differ from its entry ``first`` on, one the runner was never sent (not
        # scheduled since it got blocks: its whole tables go with it) has no row, and every other
        # one is exact.
        batch = self.runner.batch
        sent = self.scheduler.output_builder.sent
        for g in range(self.kv.num_groups):  # each KV cache group's tables
            pending = self.kv.pending_changes(g)
            tables = self.kv.group_tables[g]
            for seq in live:
                row, table = batch.row_of.get(seq.seq_id), tables.get(seq)
                first = pending.get(seq)
                if first == 0:
                    continue  # new, released or rewritten since the last step
                if first is None and table is None:
                    assert row is None, f"sequence {seq.seq_id} holds no block but keeps an input-batch row"
                    continue
                if seq.seq_id not in sent:
                    assert row is None, f"sequence {seq.seq_id} has an input-batch row it was never sent"
                    continue
                assert table is not None and row is not None, (
                    f"sequence {seq.seq_id} lacks its input-batch row"
                )
                n = len(table) if first is None else first
                assert (first is not None or batch.group_num_blocks[g][row] == n) and batch.group_tables[g][
                    row, :n
                ].tolist() == table[:n], f"the input batch's block table {g} of sequence {seq.seq_id} differs"
        pending = self.kv.pending_changes()
        live_seq_ids = {s.seq_id for s in live} | {s.seq_id for s in pending}
        assert set(batch.row_of) <= live_seq_ids, "an input-batch row outlives its sequence"
        proposer = self.runner.proposer
        if proposer is not None:  # its per-sequence state, keyed by id, goes with the sequence
            assert proposer.held_ids() <= live_seq_ids, "a proposer's state outlives its sequence"
        assert len(batch.free_rows) + batch.num_rows == len(batch.num_blocks), "an input-batch row is lost"

    # --- sizing -------------------------------------------------------------------------------
    def _kv_pages(self, num_tokens: int) -> int:
        """Pages a request of ``num_tokens`` tokens holds at most, over every KV cache group."""
        c = self.config
        return self.kv_layout.blocks_per_seq(num_tokens, c.block_size, c.max_num_batched_tokens)

    def _num_kv_blocks(self, shard: Shard) -> int:
        c = self.config
        itemsize = self.kv_dtype.itemsize
        # A block id is one page of ``slots`` layers (every layer without sliding windows).
        layout = layout_of(self.spec)
        per_token = 2 * layout.slots * shard.kv_heads(self.spec) * self.spec.head_dim * itemsize
        if self.draft_spec is not None:  # the draft model's cache has the same blocks
            d = self.draft_spec
            per_token += 2 * d.num_layers * d.num_kv_heads * d.head_dim * itemsize
        per_block = per_token * c.block_size
        if c.num_kv_blocks is not None:
            log.info("KV pool: num_kv_blocks %d (%d tokens)", c.num_kv_blocks, c.num_kv_blocks * c.block_size)
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            blocks = c.kv_cache_memory // per_block
            budget = f"kv_cache_memory {c.kv_cache_memory} bytes"
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            blocks = int(free - (1 - c.gpu_memory_utilization) * total) // per_block
            budget = (
                f"the device's free memory ({free >> 20} MiB of {total >> 20} MiB) less the "
                f"{1 - c.gpu_memory_utilization:.0%} that gpu_memory_utilization {c.gpu_memory_utilization} "
                "leaves to others (another engine in this process may hold the rest)"
            )
        else:
            per_seq = layout.blocks_per_seq(self.max_model_len, c.block_size, c.max_num_batched_tokens)
            enough = c.max_num_seqs * per_seq + int(layout.windowed)  # (+ the null page)
            available = available_memory()
            nbytes, how = cpu_default_kv_bytes(*available, ranks=shard.size, replicas=replicas_sharing())
            budget = f"a budget of {nbytes >> 20} MiB: {how}"
            if enough < nbytes // per_block:
                budget += f", cut to what {c.max_num_seqs} sequences of {self.max_model_len} tokens can hold"
            blocks = min(enough, nbytes // per_block)
        if blocks < 1:
            raise ValueError(
                f"the KV budget, {budget}, holds no block of {per_block} bytes; give more "
                "kv_cache_memory (or num_kv_blocks)"
            )
        log.info(
            "KV pool: %d blocks of %d tokens (%d tokens, %d MiB of %s%s) from %s",
            blocks,
            c.block_size,
            blocks * c.block_size,
            blocks * per_block >> 20,
            str(self.kv_dtype).removeprefix("torch."),
            ", lazily backed: resident as written" if self.device.type == "cpu" else "",
            budget,
        )
        return int(blocks)


def _adapter_names(seqs) -> tuple[str, ...]:
    return tuple(sorted({s.request.lora.name for s in seqs if s.request.lora is not None}))


def seqs_per_step(config: EngineConfig, device: torch.device, threads: int | None = None) -> int:
    """The most running sequences one step computes: the config's, else every running one on
    CUDA, and on CPU ``CPU_SEQS_PER_STEP_PER_THREAD`` per engine thread (at least
    ``CPU_MIN_SEQS_PER_STEP``)."""
    if config.max_seqs_per_step is not None:
        return config.max_seqs_per_step
    if device.type == "cpu":
        threads = torch.get_num_threads() if threads is None else threads
        seats = max(CPU_MIN_SEQS_PER_STEP, CPU_SEQS_PER_STEP_PER_THREAD * threads)
        return min(config.max_num_seqs, seats)
    return config.max_num_seqs
