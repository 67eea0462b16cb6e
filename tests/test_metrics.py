"""The metrics registry and its HTTP endpoint: what a scrape returns after known events."""

from __future__ import annotations

import time
import urllib.request
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """{sample name{labels}: value} of one scrape."""
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            le = s.labels.get("le")
            key = s.name + (f"{{{labels}}}" if labels else "") + (f"[le={le}]" if le else "")
            out[key] = s.value
    return out


def test_request_clock_counts_outcomes_tokens_and_latencies():
    m = GatewayMetrics()
    port = m.serve("127.0.0.1", 0)
    try:
        r = m.request()
        r.prompt(7)
        time.sleep(0.02)
        r.tokens(0, 1)  # first token: TTFT >= 20 ms
        r.tokens(1, 1)  # another sequence's first token: no inter-token sample
        time.sleep(0.01)
        r.tokens(0, 2)
        r.tokens(0, 0)  # a text-only message carries no tokens: no sample
        r.finish("length")
        r.finish("length")  # a second finish is ignored
        m.request().finish("invalid_argument")
        s = scrape(port)
        assert s["llmserve_requests_total{outcome=length}"] == 1
        assert s["llmserve_requests_total{outcome=invalid_argument}"] == 1
        assert s["llmserve_prompt_tokens_total"] == 7
        assert s["llmserve_generation_tokens_total"] == 4
        assert s["llmserve_time_to_first_token_seconds_count"] == 1
        assert s["llmserve_time_to_first_token_seconds_sum"] >= 0.02
        assert s["llmserve_inter_token_latency_seconds_count"] == 1
        assert s["llmserve_inter_token_latency_seconds_sum"] >= 0.01
        assert s["llmserve_e2e_request_latency_seconds_count"] == 2
        assert s["llmserve_gateway_requests_in_flight"] == 0
        assert "llmserve_engine_up" not in s  # no engine watched by this registry
    finally:
        m.close()


def test_engine_figures_come_from_the_latest_snapshot_at_scrape_time():
    m = GatewayMetrics()
    latest = {"load": None}
    m.watch_engine(lambda: latest["load"])
    m.step_time.observe(0.004)
    port = m.serve("127.0.0.1", 0)
    try:
        s = scrape(port)
        assert s["llmserve_engine_up"] == 0
        assert "llmserve_kv_cache_usage_ratio" not in s
        latest["load"] = SimpleNamespace(
            num_running=3,
            num_waiting=2,
            kv_blocks_used=16,
            kv_blocks_total=64,
            prefix_queried_tokens=100,
            prefix_hit_tokens=48,
            num_preemptions=5,
        )
        s = scrape(port)
        assert s["llmserve_engine_up"] == 1
        assert s["llmserve_num_requests_running"] == 3
        assert s["llmserve_num_requests_waiting"] == 2
        assert s["llmserve_kv_cache_usage_ratio"] == 0.25
        assert s["llmserve_prefix_cache_queried_tokens_total"] == 100
        assert s["llmserve_prefix_cache_hit_tokens_total"] == 48
        assert s["llmserve_num_preemptions_total"] == 5
        assert s["llmserve_engine_step_seconds_count"] == 1
        assert s["llmserve_engine_step_seconds_bucket[le=0.005]"] == 1
    finally:
        m.close()


def test_two_servers_keep_their_numbers_apart_and_the_port_closes():
    a, b = GatewayMetrics(), GatewayMetrics()
    pa, pb = a.serve("127.0.0.1", 0), b.serve("127.0.0.1", 0)
    a.request().finish("stop")
    assert scrape(pa)["llmserve_requests_total{outcome=stop}"] == 1
    assert "llmserve_requests_total{outcome=stop}" not in scrape(pb)
    a.close()
    b.close()
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{pa}/metrics", timeout=2)
    except OSError:
        pass
    else:
        raise AssertionError("the metrics port still answers after close()")


def test_speculation_counters_and_acceptance_rate_under_both_names():
    m = GatewayMetrics()
    latest = {"load": None}
    m.watch_engine(lambda: latest["load"])
    port = m.serve("127.0.0.1", 0)
    try:
        base = dict(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=8)
        latest["load"] = SimpleNamespace(**base, spec_draft_tokens=0, spec_accepted_tokens=0)
        s = scrape(port)
        assert s["llmserve_spec_decode_acceptance_rate"] == 0.0  # nothing drafted: no division by 0
        latest["load"] = SimpleNamespace(**base, spec_draft_tokens=40, spec_accepted_tokens=30)
        s = scrape(port)
        assert s["vllm:spec_decode_num_draft_tokens_total"] == 40
        assert s["vllm:spec_decode_num_accepted_tokens_total"] == 30
        assert s["llmserve_spec_decode_draft_tokens_total"] == 40
        assert s["llmserve_spec_decode_accepted_tokens_total"] == 30
        assert s["llmserve_spec_decode_acceptance_rate"] == 0.75
    finally:
        m.close()
