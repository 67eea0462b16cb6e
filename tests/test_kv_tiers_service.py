"""The disk tier through the service: ``llmserve serve`` stopped and started again on the same
``--kv-disk-dir`` serves a prompt it computed before from disk, the same tokens, with the tier's
figures in GetStats and on the metrics endpoint."""

from __future__ import annotations

from gateway.client import LLMServeClient
from tests.engine_helpers import random_prompts
from tests.fault_helpers import metrics_port, wait_for
from tests.service_process import ServiceProcess
from tests.test_metrics import scrape

PROMPT = random_prompts([200], 1000, seed=9)[0]  # 12 full blocks of 16


def _ask(sp: ServiceProcess) -> list[int]:
    with LLMServeClient(sp.target) as client:
        reply = client.generate(token_ids=PROMPT, max_tokens=6, temperature=0.0, return_token_ids=True)
    return list(reply.token_ids)


def _disk(sp: ServiceProcess):
    (tier,) = [t for t in sp.engine_stats().load.kv_tiers if t.tier == "disk"]
    return tier


def test_a_restarted_server_serves_the_prefix_from_disk(tiny_llama, tmp_path):
    args = (
        "--tokenizer-workers",
        "0",
        "--kv-disk-bytes",
        "64M",
        "--kv-disk-dir",
        str(tmp_path),
        "--metrics-port",
        "0",
    )
    with ServiceProcess(tiny_llama, *args) as sp:
        first = _ask(sp)
        assert _disk(sp).stored >= 12 and _disk(sp).hits == 0  # written through as computed
    with ServiceProcess(tiny_llama, *args) as sp:
        assert _ask(sp) == first
        disk, load = _disk(sp), sp.engine_stats().load
        assert disk.hits == 12 and disk.rejected == 0 and disk.load_seconds > 0
        assert load.prefix_hit_tokens == 12 * 16
        port = metrics_port(sp)
        # A heartbeat brings the figures to the gateway (the wait is a guard, not a speed bound).
        s = wait_for(
            lambda: (lambda m: m if m.get("llmserve_kv_tier_hit_blocks_total{tier=disk}") == 12 else None)(
                scrape(port)
            ),
            60.0,
            "the tier's figures did not reach the metrics endpoint",
        )
        assert s["llmserve_kv_tier_capacity_bytes{tier=disk}"] == 64 << 20
