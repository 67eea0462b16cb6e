"""Prometheus metrics of the gateway and of the engine behind it, served on their own port.

The gateway measures what a client sees (outcomes, TTFT, inter-token and end-to-end latency,
tokens in and out). The engine's figures (running and waiting requests, KV usage, prefix-cache
queried and hit tokens, preemptions) arrive with the engine's heartbeats and are read at scrape
time from the latest one; engine step times arrive with each step's output. Each server owns a
registry of its own, so two gateways in one process (tests) never mix their numbers.

The endpoint listens on 127.0.0.1 by default: metrics name no prompt, but request rates and
latencies are still nobody else's business unless the operator opens the port.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("gateway.metrics")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineLoadCollector(Collector):
    """The engine's latest load figures, read when Prometheus scrapes.

    ``snapshot()`` returns None while no engine is connected, or an object with the engine.v1
    ``Load`` fields (num_running, num_waiting, kv_blocks_used, kv_blocks_total and, when the engine
    sends them, prefix_queried_tokens, prefix_hit_tokens, num_preemptions)."""

    def __init__(self, snapshot: Callable[[], object | None], model_name: str = "") -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self):
        load = self._snapshot()
        up = GaugeMetricFamily("llmserve_engine_up", "1 while the gateway has a live engine session")
        up.add_metric([], 0.0 if load is None else 1.0)
        yield up
        if load is None:
            return
        gauges = (
            ("llmserve_num_requests_running", "Sequences the engine is running", load.num_running),
            ("llmserve_num_requests_waiting", "Sequences waiting in the engine's queue", load.num_waiting),
            ("llmserve_kv_cache_blocks_used", "KV cache blocks in use", load.kv_blocks_used),
            ("llmserve_kv_cache_blocks_total", "KV cache blocks in the pool", load.kv_blocks_total),
            (
                "llmserve_kv_cache_usage_ratio",
                "Fraction of KV cache blocks in use",
                load.kv_blocks_used / max(1, load.kv_blocks_total),
            ),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield from self._vllm_names(load)
        counters = (
            ("llmserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
            ("llmserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache"),
            ("llmserve_num_preemptions", "Sequences preempted for lack of KV blocks"),
        )
        fields = ("prefix_queried_tokens", "prefix_hit_tokens", "num_preemptions")
        for (name, doc), f in zip(counters, fields, strict=True):
            if hasattr(load, f):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(getattr(load, f)))
                yield c
        yield from _speculation_metrics(load)
        yield from _kv_tier_metrics(load)
        if getattr(load, "max_lora", 0):
            # As vLLM serves it: adapter names comma-joined in labels; the value is the time of the
            # figures (dashboards take the latest series).
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests",
                labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            )
            info.add_metric(
                [
                    ",".join(load.running_lora_adapters),
                    str(load.max_lora),
                    ",".join(load.waiting_lora_adapters),
                ],
                time.time(),
            )
            yield info

    def _vllm_names(self, load):
        """The names the Gateway API inference extension's model-server protocol reads (vLLM's,
        with its ``model_name`` label), beside ours: the same figures."""
        usage = load.kv_blocks_used / max(1, load.kv_blocks_total)
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests running in the engine", load.num_running),
            ("vllm:num_requests_waiting", "Requests waiting in the engine's queue", load.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent (vLLM's older name)", usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model_name], float(value))
            yield g


# Speculative decoding's counters, under our names and under vLLM's (dashboards built for vLLM read
# them unchanged): (field of Load, our name, vLLM's name, help).
_SPEC_COUNTERS = (
    (
        "spec_draft_tokens",
        "llmserve_spec_decode_draft_tokens",
        "vllm:spec_decode_num_draft_tokens",
        "Draft tokens verified by the target model (speculative decoding)",
    ),
    (
        "spec_accepted_tokens",
        "llmserve_spec_decode_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "Draft tokens the target model accepted (speculative decoding)",
    ),
)


# The prefix cache's tiers below the pool (engine.v1 KVTierLoad), labelled by tier: (field, name,
# help, counter?).
_KV_TIER_METRICS = (
    ("hits", "llmserve_kv_tier_hit_blocks", "Blocks loaded back into the KV pool from this tier", True),
    ("stored", "llmserve_kv_tier_stored_blocks", "Blocks written into this tier", True),
    ("evicted", "llmserve_kv_tier_evicted_blocks", "Blocks this tier's bound dropped", True),
    (
        "rejected",
        "llmserve_kv_tier_rejected_blocks",
        "Entries found bad (checksum, truncation, fingerprint): skipped",
        True,
    ),
    (
        "load_seconds",
        "llmserve_kv_tier_load_seconds",
        "Time spent reading and checking the blocks it served",
        True,
    ),
    ("bytes", "llmserve_kv_tier_bytes", "Bytes the tier holds", False),
    ("capacity_bytes", "llmserve_kv_tier_capacity_bytes", "The tier's bound in bytes", False),
)


def _kv_tier_metrics(load):
    tiers = list(getattr(load, "kv_tiers", ()))
    if not tiers:
        return
    for field, name, doc, counter in _KV_TIER_METRICS:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["tier"])
        for t in tiers:
            family.add_metric([t.tier], float(getattr(t, field)))
        yield family


def _speculation_metrics(load):
    if not hasattr(load, "spec_draft_tokens"):
        return
    for field, ours, vllms, doc in _SPEC_COUNTERS:
        for name in (ours, vllms):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(getattr(load, field)))
            yield c
    drafted, accepted = load.spec_draft_tokens, load.spec_accepted_tokens
    rate = GaugeMetricFamily(
        "llmserve_spec_decode_acceptance_rate",
        "Accepted / drafted tokens since the engine started (0 before any draft)",
    )
    rate.add_metric([], accepted / drafted if drafted else 0.0)
    yield rate


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llmserve_requests",
            "Finished requests by outcome: a finish reason (stop, length, abort) or a gRPC status",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmserve_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "llmserve_inter_token_latency_seconds",
            "Between two messages of one sequence that carry tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmserve_e2e_request_latency_seconds",
            "From a request's arrival to its end",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("llmserve_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter(
            "llmserve_generation_tokens", "Generated tokens delivered", registry=r
        )
        self.step_time = Histogram(
            "llmserve_engine_step_seconds",
            "Engine step time (schedule, forward, sample), for steps with output for this gateway",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("llmserve_gateway_requests_in_flight", "Requests the gateway holds", registry=r)
        self.auth_failures = Counter(
            "llmserve_auth_failures", "Calls refused for missing or wrong credentials", registry=r
        )
        self.engine_lost = Counter(
            "llmserve_engine_lost", "Engine sessions lost (dead, hung, or closed)", ["reason"], registry=r
        )
        self._server = None

    def watch_engine(self, snapshot: Callable[[], object | None], model_name: str = "") -> None:
        self.registry.register(EngineLoadCollector(snapshot, model_name))

    def request(self) -> RequestMetrics:
        return RequestMetrics(self)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (a daemon thread); returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RequestMetrics:
    """The clock of one request: feed it each sequence's token counts as messages go out."""

    __slots__ = (
        "_m",
        "_start",
        "_last",
        "_first_seen",
        "_done",
        "_ttft",
        "_prompt_tokens",
        "sent_tokens",
        "unconfirmed_tokens",
    )

    def __init__(self, m: GatewayMetrics) -> None:
        self._m = m
        self._start = time.perf_counter()
        self._last: dict[int, float] = {}
        self._first_seen = False
        self._done = False
        self._ttft: float | None = None
        self._prompt_tokens = 0
        # Tokens whose message the client was given (gRPC took it): the request log's count,
        # right also for a request cancelled mid-way.
        self.sent_tokens = 0
        # Tokens of the message gRPC is sending when the request ends (its send never completed:
        # a client that stopped reading). It reaches the client, before the status, if it reads again.
        self.unconfirmed_tokens = 0
        m.inflight.inc()

    def prompt(self, num_tokens: int) -> None:
        self._prompt_tokens = num_tokens
        self._m.prompt_tokens.inc(num_tokens)

    def tokens(self, index: int, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if not self._first_seen:
            self._first_seen = True
            self._ttft = now - self._start
            self._m.ttft.observe(self._ttft)
        last = self._last.get(index)
        if last is not None:
            self._m.inter_token.observe(now - last)
        self._last[index] = now
        self._m.generation_tokens.inc(num_tokens)

    def finish(self, outcome: str) -> None:
        if self._done:
            return
        self._done = True
        self._m.inflight.dec()
        self._m.requests.labels(outcome=outcome).inc()
        self._m.e2e.observe(time.perf_counter() - self._start)

    def summary(self) -> dict:
        """For the request's closing log line."""
        out = {"seconds": round(time.perf_counter() - self._start, 4), "prompt_tokens": self._prompt_tokens}
        if self._ttft is not None:
            out["ttft_s"] = round(self._ttft, 4)
        return out
