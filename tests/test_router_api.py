"""The router interfaces end to end: a real ``llmserve serve`` with two engine replicas, each with a
small KV pool. A test "router" subscribes to ``Router.StreamKvEvents``, a workload with evictions
runs through the gRPC API, and the router's replay of the events must equal each engine's own set
of cached block hashes (read independently with engine.v1 GetStats); it recomputes a prompt's block
hashes from its token ids and the tenant's salt and finds them. ``GetLoad`` reports each replica and
the sum; the metrics port serves the names the Gateway API inference extension reads."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from engine_svc.block_hash import prompt_block_hashes
from gateway.client import LLMServeClient
from llmserve_proto.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve_proto.llmserve.v1 import router_pb2, router_pb2_grpc
from tests.fault_helpers import wait_for
from tests.service_process import ServiceProcess
from tests.test_kv_events import ReplayRouter

KEY = "sk-router-test-key-0123456789"
BLOCKS = 24


@pytest.fixture(scope="module")
def service(default_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"acme {KEY}\n")
    keys.chmod(0o600)
    args = [
        "--replicas",
        "2",
        "--num-kv-blocks",
        str(BLOCKS),
        "--metrics-port",
        "0",
        "--api-key-file",
        str(keys),
    ]
    with ServiceProcess(default_model_dir, *args) as sp:
        # The gateway serves once one replica is up; these tests need both.
        with grpc.insecure_channel(sp.target) as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            def both_ready() -> bool:
                report = stub.GetLoad(router_pb2.GetLoadRequest(), metadata=metadata(), timeout=10)
                return len(report.replicas) == 2 and all(r.ready for r in report.replicas)

            wait_for(both_ready, 60, "both replicas ready", every_s=0.1)
        yield sp


def engine_addresses(sp: ServiceProcess) -> list[str]:
    line = next(x for x in sp.stdout_lines if x.startswith("llmserve: engine replicas:"))
    return re.findall(r"at (unix://\S+?)(?:,|$)", line.strip())


def cached_hashes(address: str) -> set[int]:
    with grpc.insecure_channel(address) as ch:
        st = engine_pb2_grpc.EngineStub(ch).GetStats(
            engine_pb2.GetStatsRequest(include_cached_block_hashes=True), timeout=10
        )
    return set(st.cached_block_hashes)


def metadata():
    return (("authorization", f"Bearer {KEY}"),)


class Subscription:
    """Router.StreamKvEvents read on a thread, replayed per replica."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.call = router_pb2_grpc.RouterStub(self.channel).StreamKvEvents(
            router_pb2.StreamKvEventsRequest(), metadata=metadata()
        )
        self.replicas = {0: ReplayRouter(), 1: ReplayRouter()}
        self.lock = threading.Lock()
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self.lock:
                    self.replicas[batch.replica].apply(batch)
        except grpc.RpcError as e:
            self.error = e

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)
        self.channel.close()


def test_replayed_kv_events_equal_each_replicas_cache(service):
    addresses = engine_addresses(service)
    assert len(addresses) == 2
    sub = Subscription(service.target)
    try:
        deadline = time.monotonic() + 60  # the bound: a hang
        while min(r.batches for r in sub.replicas.values()) < 1:  # both snapshots arrived
            assert time.monotonic() < deadline and sub.error is None, sub.error
            time.sleep(0.05)
        # Shared system prompts and distinct tails: 4 blocks of its own per prompt, 96 in all, twice
        # what the two 24-block pools hold together, however the router spreads them (evictions).
        prompts = [[(s * 31 + j) % 500 + 3 for j in range(40)] + [(i * 7 + j) % 500 + 3 for j in range(60)]
                   for i, s in enumerate([0, 1, 2] * 8)]  # fmt: skip
        with LLMServeClient(service.target, timeout=120, api_key=KEY) as c, ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: c.generate(token_ids=p, max_tokens=4, temperature=0.0), prompts))
        removed_any = False
        deadline = time.monotonic() + 60  # the bound: a hang
        while True:  # the last step's batch may still be on its way
            with sub.lock:
                replay = {i: set(r.cached) for i, r in sub.replicas.items()}
            engines = {i: cached_hashes(a) for i, a in enumerate(addresses)}
            if replay == engines or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sub.error is None, sub.error
        for i in replay:
            assert replay[i] == engines[i], (
                f"replica {i}: {len(replay[i] - engines[i])} hashes only in the replay, "
                f"{len(engines[i] - replay[i])} only in the engine, {sub.replicas[i].batches} batches"
            )
        assert all(engines.values()), "each replica cached something"
        for r in sub.replicas.values():
            removed_any |= len(r.parents) > len(r.cached)  # stored once, not cached now: evicted
        assert removed_any, "the workload must evict"
        # The router computes the last prompt's hashes (tenant "acme": salt "tenant:acme") and finds
        # its cached prefix on one replica; without the tenant's salt nothing matches.
        last = prompts[-1]
        want = prompt_block_hashes(last, 16, "tenant:acme")
        assert any(want[0] in cached and want[1] in cached for cached in replay.values())
        unsalted = set(prompt_block_hashes(last, 16, None))
        assert not any(unsalted & cached for cached in replay.values())
    finally:
        sub.close()
    assert service.engine_stats(check_invariants=True).invariant_error == ""


def test_get_load_per_replica_and_summed(service):
    with LLMServeClient(service.target, timeout=120, api_key=KEY) as c:
        c.generate(token_ids=list(range(3, 60)), max_tokens=8, temperature=0.0, ignore_eos=True)
    # The rates are the engine's over its last seconds, refreshed a few times a second: a fast
    # request can finish between two refreshes.
    deadline = time.monotonic() + 30  # the bound: a hang
    with grpc.insecure_channel(service.target) as ch:
        while True:
            report = router_pb2_grpc.RouterStub(ch).GetLoad(router_pb2.GetLoadRequest(), metadata=metadata())
            if report.total.generation_tokens_per_s > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert [r.replica for r in report.replicas] == [0, 1] and all(r.ready for r in report.replicas)
    assert [r.address for r in report.replicas] == engine_addresses(service)
    assert all(r.kv_blocks_total == BLOCKS and r.block_size == 16 for r in report.replicas)
    t = report.total
    assert t.kv_blocks_total == 2 * BLOCKS and t.num_running == t.num_waiting == 0
    assert t.prefix_queried_tokens == sum(r.prefix_queried_tokens for r in report.replicas) > 0
    assert 0 <= t.prefix_hit_rate <= 1 and 0 <= t.kv_usage <= 1
    assert t.generation_tokens_per_s > 0 and t.prompt_tokens_per_s > 0  # within the last seconds
    with grpc.insecure_channel(service.target) as ch, pytest.raises(grpc.RpcError) as e:
        router_pb2_grpc.RouterStub(ch).GetLoad(router_pb2.GetLoadRequest())  # keys apply here too
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_metrics_serve_the_inference_extension_names(service):
    port = next(
        int(m.group(1))
        for x in service.stdout_lines
        if (m := re.match(r"llmserve: metrics on http://\S+:(\d+)/metrics", x))
    )
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert re.search(rf'^{name}{{model_name="[^"]+"}} [0-9.e+-]+$', text, re.M), name
    assert re.search(r"^llmserve_num_requests_waiting [0-9.]+$", text, re.M)  # ours stay


def test_metrics_are_fresh_while_the_engine_is_busy(service):
    """A busy engine sends no heartbeats (its steps keep the session alive): the load figures must
    come with its steps, or a scraper would read the idle figures of before the work began."""
    port = next(
        int(m.group(1))
        for x in service.stdout_lines
        if (m := re.match(r"llmserve: metrics on http://\S+:(\d+)/metrics", x))
    )
    with LLMServeClient(service.target, timeout=120, api_key=KEY) as c:
        # As long as the 24-block pool allows (37 + 340 tokens), so that it is still running when
        # the figure shows it (a slower machine is slower at both); cancelled as soon as it does.
        stream = c.generate_stream(token_ids=list(range(3, 40)), max_tokens=340, ignore_eos=True)
        next(stream)
        running = r'^vllm:num_requests_running{model_name="[^"]+"} 1\.0$'
        deadline = time.monotonic() + 60  # the bound: a figure that never comes
        while True:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            if re.search(running, text, re.M) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        stream.cancel()
    assert re.search(running, text, re.M), text[-2000:]
