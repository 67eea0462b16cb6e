"""A request's result, and the check that it equals its own solo run.

The property under test (docs/design/batch-invariance.md): whatever shares its steps and
whatever the engine does, each request gets what it would get alone on a fresh engine. ``Result``
collects everything a request returns from the deltas; ``assert_same_as_solo`` compares two of
them, allowing only a greedy near-tie (the solo run's own top-2 gap below ``NEAR_TIE``) to flip.
Logprobs are compared bit for bit: these engines run on the CPU in fp32, where every kernel gives a
row the same bits whatever shares its step and however its prompt was chunked, recomputed after a
preemption included (a decode and a chunk's row attend in one order: kernels/cpu/native/
paged_attention.c).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine_svc import SamplingParams
from engine_svc.engine import LLMEngine
from engine_svc.outputs import RequestDelta, TokenLogprob
from tests.engine_helpers import NEAR_TIE

# Bitwise (see above); the gRPC service test, on the default model, keeps its own tolerance.
LOGPROB_TOL = 0.0


@dataclass
class Output:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_deltas_after_finish: int = 0


@dataclass
class Result:
    outputs: dict[int, Output] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    num_prompt_logprob_deltas: int = 0
    num_prompt_tokens: int | None = None
    request_finished: int = 0  # deltas that said so (must be exactly one, the last)
    embedding: bytes | None = None  # an embedding request's vector

    def add(self, d: RequestDelta) -> None:
        assert not self.request_finished, "a delta arrived after the request said it had finished"
        out = self.outputs.setdefault(d.index, Output())
        if out.finish_reason is not None:
            out.num_deltas_after_finish += 1
        out.tokens += d.new_token_ids
        out.logprobs += d.logprobs or []
        if d.finish_reason is not None:
            out.finish_reason, out.stop_token_id = str(d.finish_reason), d.stop_token_id
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
            self.num_prompt_logprob_deltas += 1
        self.num_prompt_tokens = d.num_prompt_tokens
        self.request_finished += int(d.request_finished)
        if d.embedding is not None:
            assert d.request_finished and self.embedding is None, "an embedding not on the last delta"
            self.embedding = d.embedding


def drive(engine: LLMEngine, results: dict[str, Result], max_steps: int = 20_000, on_step=None) -> None:
    """Step until nothing is left, collecting deltas; invariants after every step."""
    steps = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            results.setdefault(d.request_id, Result()).add(d)
        engine.check_invariants()
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < max_steps, "the engine did not finish"


def solo_params(params: SamplingParams) -> SamplingParams:
    """The same request, asking for top-2 logprobs too, so a greedy divergence can be judged by the
    solo run's own top-2 gap (logprobs never change tokens: that is part of what is tested)."""
    return replace(params, logprobs=max(2, params.logprobs or 0), stop=list(params.stop))


def solo(make_engine, prompt: list[int], params: SamplingParams) -> Result:
    engine = make_engine()
    engine.add_request("solo", prompt, solo_params(params))
    results: dict[str, Result] = {}
    drive(engine, results)
    return results["solo"]


def _near_tie(lp: TokenLogprob) -> bool:
    return len(lp.top_logprobs) >= 2 and lp.top_logprobs[0] - lp.top_logprobs[1] < NEAR_TIE


def _same_logprob(a: TokenLogprob, b: TokenLogprob, n: int, where: str) -> None:
    assert a.token_id == b.token_id, where
    assert a.logprob == b.logprob or abs(a.logprob - b.logprob) <= LOGPROB_TOL, (
        f"{where}: logprob {a.logprob} vs solo {b.logprob}"
    )
    assert a.top_ids[:n] == b.top_ids[:n] or any(
        abs(x - y) < NEAR_TIE for x, y in zip(b.top_logprobs, b.top_logprobs[1:], strict=False)
    ), f"{where}: top ids {a.top_ids} vs solo {b.top_ids}"
    for x, y in zip(a.top_logprobs[:n], b.top_logprobs[:n], strict=True):
        # Equal infinities (tokens masked by allowed ids or a grammar) are equal.
        assert x == y or abs(x - y) <= LOGPROB_TOL, (
            f"{where}: top logprobs {a.top_logprobs} vs solo {b.top_logprobs}"
        )


def assert_same_as_solo(rid: str, got: Result, ref: Result, params: SamplingParams) -> str | None:
    """Fail unless ``got`` equals the solo run ``ref``. Returns a note when a greedy near-tie in the
    solo run explains a divergence (the rest of that output is then not comparable)."""
    note = None
    assert got.request_finished == 1, f"{rid}: {got.request_finished} deltas said the request finished"
    assert sorted(got.outputs) == sorted(ref.outputs), f"{rid}: outputs {sorted(got.outputs)} vs solo"
    assert got.num_prompt_tokens == ref.num_prompt_tokens
    assert got.embedding == ref.embedding, f"{rid}: the embedding differs from the solo run's (bitwise)"
    for i, out in got.outputs.items():
        r = ref.outputs[i]
        where = f"{rid}[{i}]"
        assert out.num_deltas_after_finish == 0, f"{where}: deltas after its finish"
        if out.tokens != r.tokens:
            pos = next(
                (k for k, (a, b) in enumerate(zip(out.tokens, r.tokens, strict=False)) if a != b), None
            )
            tie = pos is not None and params.greedy and _near_tie(r.logprobs[pos])
            assert tie, (
                f"{where}: tokens differ from the solo run at {pos}\n  mix:  {out.tokens}\n  solo: {r.tokens}"
            )
            note = f"{where}: greedy near-tie at output {pos} (solo top-2 gap < {NEAR_TIE})"
            continue
        assert (out.finish_reason, out.stop_token_id) == (r.finish_reason, r.stop_token_id), where
        if params.logprobs is not None:
            assert len(out.logprobs) == len(r.logprobs), where
            for k, (a, b) in enumerate(zip(out.logprobs, r.logprobs, strict=True)):
                _same_logprob(a, b, params.logprobs, f"{where} logprob {k}")
        else:
            assert not out.logprobs, f"{where}: logprobs nobody asked for"
    if params.prompt_logprobs is None:
        assert got.prompt_logprobs is None and got.num_prompt_logprob_deltas == 0, rid
    else:
        assert got.num_prompt_logprob_deltas == 1, (
            f"{rid}: prompt logprobs sent {got.num_prompt_logprob_deltas} times"
        )
        assert len(got.prompt_logprobs) == got.num_prompt_tokens and got.prompt_logprobs[0] is None, rid
        assert all(e is not None for e in got.prompt_logprobs[1:]), f"{rid}: a prompt logprob is missing"
        for k, (a, b) in enumerate(zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True), 1):
            _same_logprob(a, b, params.prompt_logprobs, f"{rid} prompt logprob {k}")
    return note
