"""Two engine replicas (real processes on TCP ports) behind one gateway: prefix affinity measured
from the engines' own prefix-cache counters, load spreading, and a replica killed mid-stream."""

from __future__ import annotations

import os
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.client import LLMServeClient
from tests.fault_helpers import alive, wait_for
from tests.replica_helpers import EngineReplica, assert_pool_whole, replicas, segments_of
from tests.service_process import ServiceProcess

BLOCK = 16
SERVING = health_pb2.HealthCheckResponse.SERVING


def gateway_for(model_dir, engines: list[EngineReplica], *extra: str) -> ServiceProcess:
    args = [a for r in engines for a in ("--engine", r.address)]
    return ServiceProcess(model_dir, *args, "--tokenizer-workers", "0", *extra)


def wait_all_joined(engines: list[EngineReplica]) -> None:
    # The gateway says SERVING once one replica is in; these tests need every one in.
    for r in engines:
        wait_for(lambda r=r: r.stats().num_sessions == 1, 30, f"the gateway's session on {r.address}")


def assert_nothing_left(engines: list[EngineReplica], sp: ServiceProcess) -> None:
    pids = {r.proc.pid for r in engines} | {sp.pid}
    assert not any(alive(p) for p in pids)
    assert segments_of(pids) == []


def queried(engines: list[EngineReplica]) -> list[int]:
    return [r.stats().load.prefix_queried_tokens for r in engines]


def test_shared_prefixes_meet_on_one_replica_and_short_prompts_spread(default_model_dir):
    rng = random.Random(5)
    with replicas(default_model_dir, 2, "--num-kv-blocks", "256") as engines:
        gateway = gateway_for(default_model_dir, engines, "--engine-heartbeat-timeout", "2")
        with gateway as sp, LLMServeClient(sp.target, timeout=60) as client:
            assert sp.engine_address == f"{engines[0].address},{engines[1].address}"
            assert sp.descendants() == []  # it started no engine of its own
            wait_all_joined(engines)

            # Three groups of 6 requests, each group sharing a 4-block system prompt; within a group
            # every request lands where the first did, and finds the prefix cached there.
            for group in range(3):
                system = [rng.randrange(3, 8000) for _ in range(4 * BLOCK)]
                before = [r.stats() for r in engines]
                for i in range(6):
                    user = [rng.randrange(3, 8000) for _ in range(5 + i)]
                    out = client.generate(token_ids=system + user, max_tokens=4, temperature=0.0)
                    assert out.finish_reason
                after = [r.stats() for r in engines]
                got = [
                    a.load.prefix_queried_tokens - b.load.prefix_queried_tokens
                    for a, b in zip(after, before, strict=True)
                ]
                assert sorted(got)[0] == 0, f"group {group} was split over the replicas: {got}"
                owner = got.index(max(got))
                hits = after[owner].load.prefix_hit_tokens - before[owner].load.prefix_hit_tokens
                # The best possible: every request after the first finds the whole system prompt.
                assert hits == 5 * len(system), f"group {group}: {hits} hit tokens of {got[owner]}"

            # Short prompts (no full block: nothing to share) go wherever the load is least; sent
            # together, they split over both replicas.
            before = queried(engines)
            prompt_len = 7

            def short(i: int):
                ids = [rng.randrange(3, 8000) for _ in range(prompt_len)]
                return client.generate(token_ids=ids, max_tokens=24, temperature=0.0, ignore_eos=True)

            with ThreadPoolExecutor(8) as pool:
                assert all(o.finish_reason for o in pool.map(short, range(8)))
            per_replica = [(a - b) // prompt_len for a, b in zip(queried(engines), before, strict=True)]
            assert sum(per_replica) == 8 and min(per_replica) >= 2, per_replica

            # The last group's owner freezes (SIGSTOP: no heartbeat, no answer): within the heartbeat
            # timeout it is out, and its prefix is served by the other replica; thawed, it is back.
            frozen, other = engines[owner], engines[1 - owner]
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            try:
                before = other.stats().load.prefix_queried_tokens
                assert client.generate(token_ids=system + [7, 7], max_tokens=4).finish_reason
                assert other.stats().load.prefix_queried_tokens > before
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)
            # Back in: the prefix's requests go to it again. The engine's own session count is no
            # sign of that (the old session, cut while the engine slept, may still count until the
            # thawed engine notices), so each probe is a request and the sign is where it ran.
            probe = iter(range(8, 10_000))

            def served_by_thawed() -> bool:
                before = frozen.stats().load.prefix_queried_tokens
                assert client.generate(token_ids=system + [next(probe)] * 2, max_tokens=4).finish_reason
                return frozen.stats().load.prefix_queried_tokens > before

            wait_for(served_by_thawed, 30, "the thawed replica serving its prefix again")
            for r in engines:
                assert_pool_whole(r)
        assert sp.proc.returncode == 0
    assert_nothing_left(engines, sp)


def test_a_killed_replica_ends_streamed_requests_retries_the_rest_and_comes_back(default_model_dir):
    # One sequence at a time per engine: a second request to the same replica waits, unstreamed.
    engine_args = ("--num-kv-blocks", "256", "--max-num-seqs", "1")
    rng = random.Random(9)
    system = [rng.randrange(3, 8000) for _ in range(4 * BLOCK)]
    with replicas(default_model_dir, 2, *engine_args) as engines:
        with gateway_for(default_model_dir, engines) as sp, LLMServeClient(sp.target, timeout=120) as client:
            wait_all_joined(engines)
            streamed = client.generate_stream(
                token_ids=system + [11, 12],
                max_tokens=3000,
                temperature=0.0,
                ignore_eos=True,
                return_token_ids=True,
            )
            first = next(streamed)
            assert len(first.token_ids) >= 1
            victim = wait_for(
                lambda: next((r for r in engines if r.stats().num_live_requests == 1), None), 10, "owner"
            )
            survivor = next(r for r in engines if r is not victim)

            # Same prefix: affinity sends it to the victim too, where it queues behind the first.
            waiting_result = {}

            def queued() -> None:
                try:
                    waiting_result["out"] = client.generate(
                        token_ids=system + [13, 14],
                        max_tokens=6,
                        temperature=0.0,
                        ignore_eos=True,
                        return_token_ids=True,
                    )
                except grpc.RpcError as e:
                    waiting_result["error"] = e

            t = threading.Thread(target=queued)
            t.start()
            wait_for(lambda: victim.stats().load.num_waiting == 1, 10, "the second request queued")
            assert survivor.stats().num_live_requests == 0

            victim.kill()
            with pytest.raises(grpc.RpcError) as err:
                for _ in streamed:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # it had streamed: no retry
            t.join(60)
            assert "error" not in waiting_result, waiting_result.get("error")
            assert len(waiting_result["out"].token_ids) == 6  # retried on the survivor, unseen
            assert "lost its replica before any output; submitting it again" in sp.log_tail(20000)

            # The service keeps answering, on the survivor, for that prefix and any other.
            assert client.health_status() == SERVING
            before = survivor.stats().load.prefix_queried_tokens
            for i in range(3):
                assert client.generate(token_ids=system + [20 + i], max_tokens=4).finish_reason
            assert survivor.stats().load.prefix_queried_tokens > before

            # The victim comes back on its address; the gateway takes it in again, and the prefix
            # it owned returns to it.
            revived = EngineReplica(default_model_dir, *engine_args, port=victim.port).start()
            try:
                revived.wait_ready()
                wait_for(lambda: revived.stats().num_sessions == 1, 30, "the gateway rejoined")
                client.generate(token_ids=system + [40], max_tokens=4)
                assert revived.stats().load.prefix_queried_tokens > 0
                for r in (survivor, revived):
                    assert_pool_whole(r)
            finally:
                revived.close()
        assert sp.proc.returncode == 0
    assert_nothing_left([*engines, revived], sp)


def test_serve_with_replicas_starts_k_engines_and_leaves_nothing(default_model_dir):
    with ServiceProcess(
        default_model_dir, "--replicas", "2", "--tokenizer-workers", "0", "--transport", "shm"
    ) as sp:
        line = next(s for s in sp.stdout_lines if s.startswith("llmserve: engine replicas:"))
        pids = {int(w) for w in line.replace(",", " ").split() if w.isdigit()}
        assert len(pids) == 2 and set(sp.descendants()) >= pids
        assert sp.transport == "shared-memory"
        with LLMServeClient(sp.target, timeout=60) as client:
            outs = [client.generate(f"replica test {i}", max_tokens=4) for i in range(4)]
            assert all(o.finish_reason for o in outs)
        assert segments_of(pids)  # each engine holds this gateway's rings
        assert sp.terminate(60) == 0
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the engines gone")
    assert segments_of(pids) == []
