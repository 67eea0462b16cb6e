"""The persistent input batch against a from-scratch rebuild on every step.

A real engine (tiny Llama) runs mixes that add, remove and reuse rows: arrivals mid-decode, chunked
prefill, prefix hits, preemption and resume, n > 1 forks, aborts and long decodes whose block
tables grow. Before every forward the inputs the model receives must equal the ones rebuilt from
the sequences alone (the way the engine built them before the batch existed), and after every step
each sequence that holds blocks must own exactly one row holding its table and sampling parameters.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_svc import SamplingParams
from engine_svc import input_batch as ib
from engine_svc.input_batch import InputBatch
from engine_svc.kv_cache_manager import BlockUpdate
from engine_svc.scheduler_output import NewRequestData
from engine_svc.sequence import Request, Sequence
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts


def rebuild_inputs(seqs: list[Sequence], num_new: list[int], kv) -> dict[str, list]:
    """The step's inputs computed from the sequences and the KV manager's tables alone, one Python
    list per field."""
    block_size = kv.block_size
    ids, positions, slots, seq_lens, query_start, tables = [], [], [], [], [0], []
    sample_rows, prompt_rows = [], []  # the contract: every sample row first, then prompt-logprob rows
    start = 0
    for seq, n in zip(seqs, num_new, strict=True):
        c, table, request = seq.num_computed_tokens, kv.block_table(seq), seq.request
        ids += seq.token_ids[c : c + n]
        positions += range(c, c + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        seq_lens.append(c + n)
        query_start.append(start + n)
        tables.append(list(table))
        if c + n == seq.num_tokens:
            fan = 1 if request.forked or request.params.n == 1 else request.params.n
            sample_rows += [start + n - 1] * fan
        last_prompt = request.num_prompt_tokens - 1
        plp_due = request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent
        if plp_due and c < last_prompt:
            prompt_rows += range(start, start + min(c + n, last_prompt) - c)
        start += n
    return dict(
        input_ids=ids,
        positions=positions,
        slots=slots,
        seq_lens=seq_lens,
        query_start=query_start,
        logit_rows=sample_rows + prompt_rows,
        tables=tables,
    )


def expected_sampling_row(params: SamplingParams) -> list[float]:
    return [
        0.0 if params.greedy else params.temperature,
        params.top_k if params.top_k > 0 else 0,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
    ]


class CheckedEngine:
    """Wraps an engine so that every forward's inputs are compared with a rebuild."""

    def __init__(self, engine):
        self.engine = engine
        self.forwards = 0
        self.decode_only_forwards = 0
        runner, scheduler = engine.runner, engine.scheduler
        schedule, forward = scheduler.schedule, runner.forward
        self.current = None

        def checked_schedule():  # the scheduler's record of the step: its sequences, read below
            self.current = schedule()
            return self.current

        def checked_forward(inputs):
            out = self.current
            ref = rebuild_inputs(out.seqs, out.num_new, engine.kv)
            for name in ("input_ids", "positions", "slots", "seq_lens", "query_start", "logit_rows"):
                assert getattr(inputs, name).tolist() == ref[name], name
            width = max(len(t) for t in ref["tables"])
            assert inputs.block_tables.shape == (len(ref["tables"]), width)
            for got, table in zip(inputs.block_tables.tolist(), ref["tables"], strict=True):
                assert got[: len(table)] == table
            assert inputs.max_seq_len == max(ref["seq_lens"])
            assert inputs.max_query_len == max(out.num_new)
            self.forwards += 1
            self.decode_only_forwards += out.only_decodes
            return forward(inputs)

        scheduler.schedule = checked_schedule
        runner.forward = checked_forward

    def step(self):
        deltas = self.engine.step()
        self.engine.check_invariants()
        check_rows(self.engine)
        return deltas


def check_rows(engine) -> None:
    """Every sequence holding blocks that the runner was sent (scheduled since it took them) has one
    row, its own, with its table and sampling parameters; sequences without blocks hold none (rows
    of the ones that finished since are released at the next step's sync, when the KV cache
    manager's changes are taken)."""
    batch = engine.runner.batch
    pending = engine.kv.pending_changes()
    sent = engine.scheduler.output_builder.sent
    live = [s for r in engine.requests.values() for s in r.sequences if engine.kv.block_table(s)]
    for seq in live:
        if seq in pending:
            continue  # changed by this step's emit (a fork): carried by the next step
        if seq.seq_id not in sent:  # not scheduled since it took blocks: its tables go with it then
            assert seq.seq_id not in batch.row_of
            continue
        row = batch.row_of[seq.seq_id]
        table = engine.kv.block_table(seq)
        n = len(table)
        assert batch.num_blocks[row] == n
        assert batch.block_tables[row, :n].tolist() == table
        assert batch.sampling[row].tolist() == pytest.approx(expected_sampling_row(seq.request.params))
        p = seq.request.params
        assert batch.flags[row, ib.SEEDED] == (p.seed is not None)
        assert batch.flags[row, ib.LOGPROBS] == (p.logprobs is not None)
        assert batch.flags[row, ib.MIN_TOKENS] == (p.min_tokens > 0)
    rows = list(batch.row_of.values())
    assert len(rows) == len(set(rows)), "two sequences share a row"
    assert not set(rows) & set(batch.free_rows), "a row is both held and free"
    assert len(rows) + len(batch.free_rows) == len(batch.num_blocks)
    held_ids = {s.seq_id for s in live}
    stale = set(batch.row_of) - held_ids
    pending_ids = {s.seq_id for s in pending}
    assert stale <= pending_ids, "a row outlived its sequence's blocks"


def drive(checked: CheckedEngine, max_steps: int = 5000) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while checked.engine.has_unfinished_requests():
        for d in checked.step():
            out.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        steps += 1
        assert steps < max_steps
    return out


def test_rows_follow_arrivals_chunks_prefix_hits_and_aborts(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=300, max_num_batched_tokens=40)
    checked = CheckedEngine(engine)
    rng = random.Random(7)
    shared = random_prompts([12], 1024, seed=3)[0]
    prompts = random_prompts([rng.randrange(2, 30) for _ in range(24)], 1024, seed=5)
    pending = [(f"r{i}", (shared + p) if i % 3 == 0 else p) for i, p in enumerate(prompts)]
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:  # arrivals while others decode
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 25)))
        if step == 9:
            engine.abort_request("r2")
        checked.step()
        step += 1
        assert step < 2000
    assert_pool_whole(engine)
    assert engine.kv.hit_tokens > 0, "the mix must include prefix-cache hits"
    assert checked.decode_only_forwards > 0 and checked.forwards > checked.decode_only_forwards
    batch = engine.runner.batch
    engine.step()  # an idle step still carries the last releases to the batch
    assert batch.num_rows == 0, "every row was released"
    assert len(batch.num_blocks) == 64, "rows were reused, not grown"


def test_rows_survive_preemption_and_resume(tiny_llama):
    # Too few blocks for everyone: the newest running sequences are preempted and recomputed.
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=9, max_num_batched_tokens=64)
    checked = CheckedEngine(engine)
    for i, prompt in enumerate(random_prompts([10, 9, 8, 7], 1024, seed=11)):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=14))
    outputs = drive(checked)
    assert engine.stats().num_preemptions > 0
    assert all(len(t) == 14 for t in outputs.values())
    assert_pool_whole(engine)


def test_forks_and_mixed_sampling_features(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=300, max_num_batched_tokens=32)
    checked = CheckedEngine(engine)
    prompts = random_prompts([9, 6, 13, 5, 7], 1024, seed=13)
    params = [
        SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.9, max_tokens=9, prompt_logprobs=1),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=8),
        SamplingParams(temperature=0, min_tokens=4, max_tokens=6, stop_token_ids=[5]),
    ]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"f{i}", prompt, p)
    outputs = drive(checked)
    assert sorted(k for k in outputs if k[0] in ("f0", "f2")) == [
        ("f0", 0),
        ("f0", 1),
        ("f0", 2),
        ("f2", 0),
        ("f2", 1),
    ]
    assert_pool_whole(engine)


def test_long_decodes_grow_tables_past_the_initial_width(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=200, max_model_len=128)
    engine.runner.batch = InputBatch(max_blocks_per_seq=2)  # force widening as the tables grow
    checked = CheckedEngine(engine)
    for i, prompt in enumerate(random_prompts([5, 3], 1024, seed=17)):
        engine.add_request(f"g{i}", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    outputs = drive(checked)
    assert all(len(t) == 60 for t in outputs.values())
    assert engine.runner.batch.block_tables.shape[1] >= 8


def _seq(i: int) -> Sequence:
    request = Request(f"u{i}", [1, 2, 3], SamplingParams(temperature=0.5 + i), 0, None, i, 4)
    return Sequence(request, 0, [1, 2, 3])


def _new(seq: Sequence, table: list[int]) -> NewRequestData:
    r = seq.request
    return NewRequestData(seq.seq_id, r.request_id, 0, [1, 2, 3], 3, 0, 7, r.params, [list(table)])


def test_apply_adds_grows_rewrites_releases_and_reuses_rows():
    batch = InputBatch(max_blocks_per_seq=2, rows=2)
    seqs = [_seq(i) for i in range(5)]
    tables = {s: [10 * i + 1] for i, s in enumerate(seqs)}
    batch.apply([], [], [_new(s, t) for s, t in tables.items()])  # more than rows: they grow
    assert batch.num_rows == 5 and len(batch.num_blocks) >= 5
    tables[seqs[1]] += [50, 51, 52]  # past the initial width: the tables widen
    tables[seqs[3]][0] = 99  # a copy-on-write replaces an entry in place
    batch.apply([BlockUpdate(seqs[1].seq_id, 1, [50, 51, 52]), BlockUpdate(seqs[3].seq_id, 0, [99])], [])
    released_row = batch.row_of[seqs[2].seq_id]
    del tables[seqs[2]]
    batch.apply([], [seqs[2].seq_id])  # freed
    newcomer = _seq(9)
    tables[newcomer] = [7, 8]
    batch.apply([], [], [_new(newcomer, [7, 8])])
    assert batch.row_of[newcomer.seq_id] == released_row, "a released row is reused"
    for s, table in tables.items():
        row = batch.row_of[s.seq_id]
        assert batch.num_blocks[row] == len(table)
        assert batch.block_tables[row, : len(table)].tolist() == table
        assert batch.sampling[row, ib.TEMPERATURE] == pytest.approx(s.request.params.temperature)
    live = list(tables)
    rows = np.array(batch.rows([s.seq_id for s in live]))
    gathered = batch.gather_tables(rows)
    assert gathered.shape == (len(live), 4)
    assert seqs[2].seq_id not in batch.row_of
