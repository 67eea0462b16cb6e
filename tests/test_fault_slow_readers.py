"""Slow readers at the default serve options (issues 17 and 27), through a real service.

300 GenerateStream clients (max_tokens=3000, ignore_eos, logprobs=20) over 8 channels never read.
Beside them, 5 normal 16-token Generate requests are served while every paused stream still waits
for its stall timeout (so none waited for a slot or seat that only the timeout frees; their latency
is printed, not asserted: a busy machine makes any bound flaky); the stalled streams end with
RESOURCE_EXHAUSTED; gateway memory stays bounded; every stream ended by the gateway is
logged with the tokens gRPC really took for it; the pool is whole afterwards.

The service runs with no option but ``--model`` (default limits: 256 slots of which 32 kept for new
clients, 256 engine seats, ``--stream-pause-after 1``, ``--max-paused-streams 256``, a 30 s stall
timeout; the KV pool sized by the engine's default). What the defence does (docs/slow-readers.md):
a stream whose output waits unread for a second is paused in the engine and gives its admission slot
and engine seat back, so the burst never holds the slots a reading client needs; past 256 paused
streams the ones unread longest are shed; 30 s after a client stopped reading its stream ends.

The model is the tiny random one (``default_model_dir``, as ``python -m
engine_svc.models.build_default`` builds it), not the real default SmolLM2-135M that ``make model``
puts in models/default: the test measures the gateway's and scheduler's defence, which is the same
for both, and on the real model it takes about 70 s more. Measured there (2-core AVX2 machine, two
engine threads, LLMSERVE_SLOW_READER_MODEL=models/default): the burst is all paused or shed 19 s in,
and the five normal requests sent after that take at worst 261 ms (1.17x alone). What this test does
not cover, and issue 37 still asks for: a normal request sent one second after the burst opens took
15-17 s there, because until the burst is seen not to read, every step carries its ~225 streams
(about 1.5 s a step with logprobs=20 on that machine).

The stalled client announces 1 KiB flow-control windows (no BDP growth), so that gRPC stops taking
the gateway's messages after a few: a default client's 64 KiB and more hold some 200 messages of
logprobs=20 per stream before the gateway can tell that nobody reads them (see the docs).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import grpc
import pytest

from gateway.client import LLMServeClient, build_request
from gateway.limits import Limits
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.fault_helpers import assert_engine_clean, memory_bytes, stop_and_check, wait_for
from tests.service_process import ServiceProcess

READERS = 300
TOKENS = 3000
CHANNELS = 8
NORMAL = 5
D = Limits()
STALL_S = D.stream_stall_timeout_s
MAX_PAUSED = D.max_paused_streams
_FINISHED = re.compile(
    r"request_id=(\S+) finished outcome=\"(\w+)\" completion_tokens=(\d+)(?: unconfirmed_tokens=(\d+))?"
)


@pytest.fixture(scope="module")
def svc(default_model_dir):
    # The default serve options, all of them (LLMSERVE_SLOW_READER_ARGS adds some, to try others;
    # LLMSERVE_SLOW_READER_MODEL serves another model, e.g. models/default as `make model` builds it).
    model = os.environ.get("LLMSERVE_SLOW_READER_MODEL") or default_model_dir
    sp = ServiceProcess(model, *os.environ.get("LLMSERVE_SLOW_READER_ARGS", "").split()).start()
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


def rss_mib(pid: int) -> float:
    return memory_bytes(pid)["rss"] / 2**20


def finished_lines(sp: ServiceProcess) -> dict[str, tuple[str, int, int]]:
    """request id -> (outcome, completion_tokens, unconfirmed_tokens) from the gateway's 'finished'
    log lines: the tokens of messages gRPC took, and of the one it was still sending."""
    text = Path(sp._log.name).read_text(errors="replace")
    return {m[1]: (m[2], int(m[3]), int(m[4] or 0)) for m in _FINISHED.finditer(text)}


def drain(call) -> tuple[int, grpc.RpcError | None]:
    """Read a stalled call at last: the tokens gRPC had buffered for it, then its status."""
    tokens = 0
    try:
        for msg in call:
            tokens += len(msg.token_ids)
    except grpc.RpcError as e:
        return tokens, e
    return tokens, None


def test_300_never_read_streams_at_the_defaults_leave_normal_requests_served(svc):
    gw = svc.pid
    with LLMServeClient(svc.target, timeout=60) as client:
        client.generate("warm up", max_tokens=16, ignore_eos=True)
        alone = []
        for i in range(3):  # the same request alone, for the ratio (the best of 3: the machine is noisy)
            t0 = time.monotonic()
            client.generate(f"alone {i}", max_tokens=16, ignore_eos=True)
            alone.append(time.monotonic() - t0)
        alone_s = min(alone)
        rss = {"before": rss_mib(gw)}

        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        channels = [grpc.insecure_channel(svc.target, options=options) for _ in range(CHANNELS)]
        stubs = [gen_grpc.GenerationStub(ch) for ch in channels]
        started = time.monotonic()
        calls = [
            stubs[i % CHANNELS].GenerateStream(
                build_request(
                    f"never read {i}",
                    request_id=f"stalled-{i}",
                    max_tokens=TOKENS,
                    ignore_eos=True,
                    logprobs=20,
                    return_token_ids=True,
                ),
                timeout=300,
            )
            for i in range(READERS)
        ]

        # Every stream is seen not to read within seconds: all of it paused in the engine, and the
        # oldest unread shed past max_paused_streams (none of them holds a slot or a seat now).
        def settled():
            st = svc.engine_stats()
            ended = [r for r in finished_lines(svc) if r.startswith("stalled-")]
            live = st.num_live_requests
            return live == st.load.num_paused <= MAX_PAUSED and len(ended) + live == READERS

        wait_for(settled, 60, "the never-read streams were not all paused or shed", every_s=0.2)
        settled_s = time.monotonic() - started
        st = svc.engine_stats()
        paused = st.load.num_paused
        assert paused == MAX_PAUSED, paused
        rss["paused"] = rss_mib(gw)
        steps = st.load.num_steps
        time.sleep(1.0)
        assert svc.engine_stats().load.num_steps == steps, "the engine stepped paused requests"

        # Normal traffic beside them, from a client that holds no slot.
        latencies = []
        for i in range(NORMAL):
            t = time.monotonic()
            out = client.generate(f"a normal request {i}", max_tokens=16, ignore_eos=True, timeout=30)
            latencies.append(time.monotonic() - t)
            assert out.usage.completion_tokens == 16
        rss["during"] = rss_mib(gw)
        p99 = max(latencies)  # of 5: the worst (printed below)
        # Served while the paused streams still wait for their timeout: none of the five needed what
        # only that timeout frees.
        assert svc.engine_stats().num_live_requests == MAX_PAUSED, latencies

        # The stall timeout, counted from when each client stopped reading, ends the rest.
        wait_for(
            lambda: svc.engine_stats().num_live_requests == 0, STALL_S + 30, "stalled requests not aborted"
        )
        ended_s = time.monotonic() - started
        assert ended_s >= STALL_S, ended_s  # none was ended by the timeout before it ran out

        # Every slot is free again: as many requests at once as the limit's share for one client.
        results: dict[int, object] = {}

        def normal(i: int) -> None:
            try:
                results[i] = client.generate(f"after {i}", max_tokens=8, ignore_eos=True, timeout=60)
            except grpc.RpcError as e:
                results[i] = e

        threads = [threading.Thread(target=normal, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        errors = [r for r in results.values() if isinstance(r, grpc.RpcError)]
        assert not errors and len(results) == 16, [(e.code(), e.details()) for e in errors]

        # The stalled clients, reading at last, get what gRPC had taken, then a clear status; the
        # gateway's log says how each ended and how many tokens it sent, which is what they read.
        logged = finished_lines(svc)
        outcomes = {"stalled": 0, "shed": 0}
        read = unconfirmed = 0
        for i, call in enumerate(calls):
            tokens, err = drain(call)
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (i, err)
            outcome, sent, in_flight = logged[f"stalled-{i}"]
            limit = "stream_stall_timeout_s" if outcome == "stalled" else "max_paused_streams"
            assert limit in err.details(), (outcome, err.details())
            assert tokens == sent + in_flight, (i, outcome, sent, in_flight, tokens)
            outcomes[outcome] += 1
            read += tokens
            unconfirmed += in_flight
        assert outcomes == {"stalled": MAX_PAUSED, "shed": READERS - MAX_PAUSED}, outcomes
        for ch in channels:
            ch.close()
        time.sleep(1.0)
        rss["after"] = rss_mib(gw)
    print(
        f"\n{READERS} never-read streams of {TOKENS} tokens (logprobs=20) over {CHANNELS} channels at the "
        f"defaults: {paused} paused and {outcomes['shed']} shed {settled_s:.1f}s in; every one ended "
        f"by {ended_s:.1f}s (stall timeout {STALL_S:g}s), their clients read {read} tokens at last "
        f"({unconfirmed} of them in messages gRPC was still sending); {NORMAL} normal 16-token "
        f"requests beside them: worst {p99 * 1000:.0f} ms, {p99 / alone_s:.2f}x the same request alone "
        f"({alone_s * 1000:.0f} ms); gateway RSS before {rss['before']:.0f}, paused {rss['paused']:.0f}, "
        f"during {rss['during']:.0f}, after {rss['after']:.0f} MiB"
    )
    assert rss["during"] - rss["before"] < 128, rss
    assert_engine_clean(svc)
