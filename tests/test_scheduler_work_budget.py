"""The step's work budget, without a model: a chunk deep in a long prompt gets fewer tokens than one
at its start, no step's planned work passes the budget (but for the one-block floor that keeps a
prompt advancing), decodes are still served first, and chunks cut by work end on block bounds."""

from __future__ import annotations

import pytest

from engine_svc import EngineConfig
from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.scheduler import Scheduler
from engine_svc.step_cost import StepCost, attention_work_ratio
from tests.test_step_contract import add, fake_result, step

BS = 16
RATIO = 1 / 512  # a token at depth 512 costs twice one at depth 0


def make(budget=256, ratio=RATIO, num_blocks=2048, **kw) -> Scheduler:
    config = EngineConfig(
        model="unused", block_size=BS, max_num_batched_tokens=budget, attention_work_ratio=ratio, **kw
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_prefix_caching=True))


def planned_work(sched: Scheduler, out) -> float:
    """The step's work as the cost rule counts it (computed counters are read before the update)."""
    return sum(sched.cost.chunk(s.num_computed_tokens, n) for s, n in zip(out.seqs, out.num_new, strict=True))


def test_a_deep_chunk_gets_fewer_tokens_and_no_step_passes_the_budget():
    sched = make()
    request = add(sched, "long", list(range(3, 3 + 8000)))
    seq = request.sequences[0]
    chunks, starts = [], []
    while seq.num_computed_tokens < 8000:
        out = sched.schedule()
        (n,) = out.num_new
        assert planned_work(sched, out) <= sched.cost.budget
        starts.append(seq.num_computed_tokens)
        chunks.append(n)
        sched.update_from_output(out, fake_result(out))
    assert chunks[0] == 256  # at depth 0 the token budget is the work budget
    assert chunks[-2] < chunks[0] / 4  # ~7.5k deep: a token costs ~15 at depth 0's
    assert all(b <= a for a, b in zip(chunks[:-1], chunks[1:], strict=True))
    # Cut by work, each chunk ends on a block boundary (the last one ends with the prompt).
    assert all((s + n) % BS == 0 for s, n in zip(starts[:-1], chunks[:-1], strict=True))


def test_tokens_alone_when_the_ratio_is_zero():
    sched = make(ratio=0.0)
    request = add(sched, "long", list(range(3, 3 + 2000)))
    seq = request.sequences[0]
    sizes = []
    while seq.num_computed_tokens < 2000:
        out, _ = step(sched)
        sizes += out.num_new
    assert sizes == [256] * 7 + [2000 - 7 * 256]


def test_decodes_first_and_the_prompt_gets_the_work_they_leave():
    sched = make(budget=256, max_num_seqs=64)
    for k in range(8):  # eight streams decoding at depth ~1000
        add(sched, f"d{k}", list(range(3, 3 + 1000)), max_tokens=200)
    while any(s.num_computed_tokens < 1000 for s in sched.running) or sched.waiting.ready:
        step(sched)
    assert len(sched.running) == 8
    add(sched, "long", list(range(5000, 9000)))  # no prefix shared with the streams'
    chunks = []
    for _ in range(60):
        out = sched.schedule()
        decodes = [s for s in out.seqs if s.request.request_id.startswith("d")]
        assert len(decodes) == 8 and out.seqs[:8] == decodes  # every stream, first, each step
        (long_seq, n) = (out.seqs[8], out.num_new[8])
        floor = BS - long_seq.num_computed_tokens % BS
        assert planned_work(sched, out) <= sched.cost.budget or n <= floor
        chunks.append(n)
        sched.update_from_output(out, fake_result(out, token=5))
    # The decodes' work is taken from the prompt's: 248 tokens fit the token budget, fewer the work.
    assert chunks[0] < 248 and chunks[-1] < chunks[0] and long_seq.num_computed_tokens == sum(chunks)


def test_the_first_chunk_of_a_step_always_advances():
    # A budget that one token at depth 1000 already overruns: the prompt still advances a block
    # (to the next boundary) a step, never stalls.
    sched = make(budget=4, ratio=0.01)
    request = add(sched, "long", list(range(3, 3 + 1200)))
    seq = request.sequences[0]
    seq_steps = 0
    while seq.num_computed_tokens < 1200:
        before = seq.num_computed_tokens
        step(sched)
        assert seq.num_computed_tokens > before
        seq_steps += 1
    assert seq_steps < 1200


def test_max_tokens_is_the_largest_chunk_that_fits():
    cost = StepCost(2048, 3e-4)
    for start in (0, 1, 100, 5000, 16000, 100_000):
        for work in (0.5, 1, 10, 777.7, cost.budget):
            n = cost.max_tokens(start, work, 10_000)
            assert n == 0 or cost.chunk(start, n) <= work
            assert cost.chunk(start, n + 1) > work
    assert cost.max_tokens(0, cost.budget, 2048) == 2048
    assert cost.max_tokens(16000, cost.budget, 2048) < 2048 // 4


def test_ratio_from_the_model_shape():
    # SmolLM2-135M: hidden 576, 9 heads / 3 kv heads of 64, intermediate 1536.
    r = attention_work_ratio(576, 9, 3, 64, 1536)
    assert r == pytest.approx(2 * 576 / (576 * 960 + 576 * 576 + 3 * 576 * 1536))
    with pytest.raises(ValueError, match="attention_work_ratio"):
        EngineConfig(model="x", attention_work_ratio=-1.0).validate()
    with pytest.raises(ValueError, match="attention_work_ratio"):
        StepCost(16, float("nan"))


def test_beside_decodes_a_prompt_chunk_keeps_the_step_within_the_stall_factor():
    sched = make(budget=2048, max_num_seqs=64, decode_stall_factor=3.0)
    floor = sched.step_floor
    for k in range(2):  # two streams decoding at depth ~1000
        add(sched, f"d{k}", list(range(3, 3 + 1000)), max_tokens=4000)
    while any(s.num_computed_tokens < 1000 for s in sched.running) or sched.waiting.ready:
        step(sched)
    add(sched, "long", list(range(5000, 9000)))  # 4,000 tokens
    long_seq = None
    deep = 0
    while long_seq is None or long_seq.num_computed_tokens < 4000:
        out = sched.schedule()
        decodes = [s for s in out.seqs if s.request.request_id.startswith("d")]
        assert len(decodes) == 2  # the streams take every step
        decode_work = sum(sched.cost.chunk(s.num_computed_tokens, 1) for s in decodes)
        pairs = zip(out.seqs, out.num_new, strict=True)
        chunks = [(s, n) for s, n in pairs if s.request.request_id == "long"]
        if chunks:
            ((long_seq, n),) = chunks
            assert n >= 1  # it always advances
            work = planned_work(sched, out)
            one_token = sched.cost.chunk(long_seq.num_computed_tokens, 1)
            assert floor + work <= 3.0 * (floor + decode_work) or n == 1 and work - one_token <= decode_work
            deep += long_seq.num_computed_tokens > 3000
        sched.update_from_output(out, fake_result(out, token=5))
    assert deep  # the bound held deep in the prompt too
    # Alone (no decode in the step), a prompt takes the whole budget again.
    sched2 = make(budget=2048, decode_stall_factor=3.0)
    request = add(sched2, "alone", list(range(3, 3 + 4000)))
    out = sched2.schedule()
    assert out.num_new == [2048] and request.sequences[0] is out.seqs[0]


def test_the_floor_is_measured_from_step_times():
    """On a machine whose weight read costs 4 token-equivalents (not the default 16), the fitted
    floor finds it and keeps a step beside a decode within the factor of the decode alone; the
    fixed default lets it run ~2.5x over. Step times come from that machine's cost: max(read,
    compute), the GEMMs' shape, not the line the fit assumes."""
    read, per_work = 0.020, 0.005  # seconds: one weight read; one token-equivalent of compute

    def seconds(work):
        return max(read, per_work * work)

    def worst_ratio(measure):
        ratio = 1.2e-4  # Qwen2.5-Coder-0.5B's attention_work_ratio
        config = EngineConfig(model="unused", block_size=BS, max_num_batched_tokens=2048,
                              attention_work_ratio=ratio, decode_stall_factor=3.0)  # fmt: skip
        sched = Scheduler(config, KVCacheManager(2048, BS, True), None, ratio, None, (3.0, 16.0),
                          measure_floor=measure)  # fmt: skip
        add(sched, "d", list(range(3, 35)), max_tokens=5000)
        decode_alone = None
        for _ in range(40):  # the stream alone
            out = sched.schedule()
            decode_alone = seconds(planned_work(sched, out))
            sched.note_step_time(out, decode_alone, sched.update_from_output(out, fake_result(out, 5)))
        add(sched, "long", list(range(5000, 8000)))
        beside = []
        for _ in range(200):
            out = sched.schedule()
            t = seconds(planned_work(sched, out))
            if len(out.seqs) == 2:
                beside.append(t / decode_alone)
            sched.note_step_time(out, t, sched.update_from_output(out, fake_result(out, 5)))
        beside = beside[5:]  # the first steps, planned before there was anything to measure
        return max(beside), sched

    measured, sched = worst_ratio(True)
    fixed, _ = worst_ratio(False)
    assert 3.0 < sched.floor_fit.floor(16.0) < 6.0
    assert measured <= 3.0 * 1.25 and fixed > 2.0 * 3.0, (measured, fixed)


def test_decodes_alone_pay_no_cap_pass_and_the_floor_fit_gets_each_steps_planned_work(monkeypatch):
    """The decode cap is settled at a step's first prompt chunk (or preemption), so a step of decodes
    alone never walks the running sequences for it; and the work the floor fit is told of, read from
    the budget's charges, is each step's planned work: decodes alone, capped beside a prompt, and
    through preemptions."""
    ratio = 1.2e-4
    config = EngineConfig(model="unused", block_size=BS, max_num_batched_tokens=512,
                          attention_work_ratio=ratio, decode_stall_factor=3.0)  # fmt: skip
    sched = Scheduler(
        config, KVCacheManager(40, BS, True), None, ratio, None, (3.0, 16.0), measure_floor=True
    )
    passes = []
    original = sched._decode_cap
    monkeypatch.setattr(sched, "_decode_cap", lambda out: passes.append(1) or original(out))
    told = []
    observe = sched.floor_fit.observe
    monkeypatch.setattr(
        sched.floor_fit, "observe", lambda work, s, c: told.append(work) or observe(work, s, c)
    )
    for k in range(4):
        add(sched, f"d{k}", list(range(3 + k, 40 + k)), max_tokens=400)
    seen = {"decodes": 0, "capped": 0, "preempted": 0}
    for i in range(300):
        if i == 30:
            add(sched, "long", list(range(5000, 5400)))  # beside the decodes, then the pool runs dry
        before = len(passes)
        out = sched.schedule()
        expected = planned_work(sched, out)
        sched.note_step_time(out, 0.01, sched.update_from_output(out, fake_result(out, 5)))
        if not out.seqs:
            continue
        assert told[-1] == pytest.approx(expected, rel=1e-12, abs=1e-9), i
        if out.only_decodes and not sched.waiting.ready and not out.preempted:
            assert len(passes) == before, (
                f"step {i}: a step of decodes alone walked the running ones for the cap"
            )
            seen["decodes"] += 1
        seen["capped"] += len(passes) > before and any(s.request.request_id == "long" for s in out.seqs)
        seen["preempted"] += bool(out.preempted)
    assert all(seen.values()), seen
