"""The metrics endpoint and the structured logs of a real service, after known traffic."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from gateway.client import LLMServeClient
from tests.fault_helpers import assert_engine_clean, metrics_port, stop_and_check, wait_for
from tests.service_process import ServiceProcess
from tests.test_metrics import scrape

SECRET = "zebra-quokka-7731 my card number"


def _traffic(sp: ServiceProcess) -> None:
    with LLMServeClient(sp.target, timeout=30) as c:
        c.generate(SECRET, max_tokens=6, ignore_eos=True, request_id="req-ok")
        c.generate(token_ids=list(range(200, 264)), max_tokens=3, ignore_eos=True, request_id="req-prefix-1")
        c.generate(token_ids=list(range(200, 264)), max_tokens=3, ignore_eos=True, request_id="req-prefix-2")
        with pytest.raises(grpc.RpcError):
            c.generate(SECRET, temperature=-1.0, request_id="req-bad")
        stream = c.generate_stream(SECRET, max_tokens=500, ignore_eos=True, request_id="req-cancel")
        next(iter(stream))
        stream.cancel()


def _json_lines(sp: ServiceProcess) -> list[dict]:
    out = []
    for line in sp.log_tail(10**7).splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_metrics_count_what_happened_and_logs_carry_request_ids_but_no_prompt(tiny_llama):
    sp = ServiceProcess(
        tiny_llama, "--tokenizer-workers", "1", "--metrics-port", "0", "--log-format", "json"
    ).start()
    try:
        port = metrics_port(sp)
        _traffic(sp)
        assert_engine_clean(sp)

        def settled():  # the cancel is counted, and a heartbeat has brought the engine's figures
            s = scrape(port)
            done = s.get("llmserve_requests_total{outcome=cancelled}") == 1
            idle = s.get("llmserve_num_requests_running") == 0 == s.get("llmserve_num_requests_waiting")
            return s if done and idle and s.get("llmserve_prefix_cache_hit_tokens_total", 0) >= 48 else None

        s = wait_for(settled, 5.0, "the metrics did not settle")
        assert s["llmserve_requests_total{outcome=length}"] == 3
        assert s["llmserve_requests_total{outcome=invalid_argument}"] == 1
        assert s["llmserve_time_to_first_token_seconds_count"] == 4
        assert s["llmserve_e2e_request_latency_seconds_count"] == 5
        assert s["llmserve_inter_token_latency_seconds_count"] >= 5 + 2 + 2
        assert s["llmserve_generation_tokens_total"] >= 6 + 3 + 3 + 1
        assert s["llmserve_prompt_tokens_total"] >= 64 * 2
        assert s["llmserve_engine_up"] == 1
        assert s["llmserve_engine_step_seconds_count"] >= 12
        assert s["llmserve_prefix_cache_queried_tokens_total"] >= 128
        assert s["llmserve_prefix_cache_hit_tokens_total"] >= 48  # the second prefix request
        assert "llmserve_kv_cache_usage_ratio" in s and "llmserve_num_preemptions_total" in s
        assert s["llmserve_num_requests_running"] == 0 and s["llmserve_gateway_requests_in_flight"] == 0
        outward = _outward_address()
        if outward is not None:  # loopback only by default: another interface is refused
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://{outward}:{port}/metrics", timeout=2)

        lines = _json_lines(sp)
        assert lines, "no JSON log lines"
        by_request = {}
        for line in lines:
            if line.get("logger") == "gateway.requests":
                assert line.get("request_id"), line  # every request line names its request
                by_request.setdefault(line["request_id"], []).append(line)
        assert {"req-ok", "req-prefix-1", "req-prefix-2", "req-bad", "req-cancel"} <= set(by_request)
        finished = {rid: ls[-1] for rid, ls in by_request.items()}
        assert finished["req-ok"]["outcome"] == "length" and finished["req-ok"]["completion_tokens"] == 6
        assert finished["req-bad"]["outcome"] == "invalid_argument"
        assert finished["req-cancel"]["outcome"] == "cancelled"
        assert by_request["req-ok"][0]["prompt_chars"] == len(SECRET)
        assert SECRET not in sp.log_tail(10**7)
        stop_and_check(sp)
    finally:
        sp.kill()


def test_log_prompts_puts_the_prompt_in_the_request_line_and_ids_cannot_forge_lines(tiny_llama):
    sp = ServiceProcess(
        tiny_llama, "--tokenizer-workers", "0", "--log-format", "text", "--log-prompts"
    ).start()
    try:
        with LLMServeClient(sp.target, timeout=30) as c:
            c.generate(SECRET + "\nFAKE-LINE", max_tokens=2, request_id="req-logged")
            with pytest.raises(grpc.RpcError) as e:
                c.generate("hi", max_tokens=2, request_id="x\n2026-01-01T00:00:00.000 gateway[1] INFO FORGED")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        log = sp.log_tail(10**7)
        first = next(line for line in log.splitlines() if "request_id=req-logged request " in line)
        assert json.dumps(SECRET + "\nFAKE-LINE") in first  # the prompt, escaped onto its one line
        assert not [line for line in log.splitlines() if line.startswith(("FAKE-LINE", "2026-01-01"))]
        assert "request_id=unprintable-" in log
        stop_and_check(sp)
    finally:
        sp.kill()


def _outward_address() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this picks the outward interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr
