"""LoRA through the real service (engine, tokenizer worker and gateway processes): adapters loaded
at start (--lora-modules) and at run time with streams open, requests naming them get the offline
engine's tokens, unload, NOT_FOUND for unknown names, INVALID_ARGUMENT for bad loads (the service
unchanged), and vLLM's lora_requests_info metric."""

from __future__ import annotations

import time

import grpc
import pytest

from engine_svc import LLM, LoRARequest, SamplingParams
from gateway.client import LLMServeClient
from tests.engine_helpers import random_prompts
from tests.fault_helpers import assert_engine_clean, metrics_port, wait_for
from tests.lora_helpers import ALL_TARGETS, make_adapter
from tests.service_process import ServiceProcess
from tests.test_metrics import scrape

MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("svc-adapters")
    return {
        "start": make_adapter(tiny_llama, root / "start", 8, ["q_proj", "v_proj", "down_proj"], seed=1),
        "late": make_adapter(tiny_llama, root / "late", 16, ALL_TARGETS, alpha=8.0, rslora=True, seed=2),
        "wide": make_adapter(tiny_llama, root / "wide", 32, ["q_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def service(tiny_llama, adapters):
    args = ["--tokenizer-workers", "1", "--num-kv-blocks", "256", "--metrics-port", "0", "--http-port", "0"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    # An unread stream is paused after a few messages: the engine goes quiet with its request
    # running, and its heartbeat brings the load figures (the metric test reads them then).
    args += ["--max-unsent-messages", "4"]
    args += ["--lora-modules", f"start={adapters['start']}"]
    with ServiceProcess(tiny_llama, *args) as sp:
        yield sp


@pytest.fixture(scope="module")
def offline(tiny_llama, adapters):
    prompts = random_prompts([5, 19], 1024, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = {}
    with LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64) as llm:
        for i, name in enumerate(["start", "late"]):
            req = LoRARequest(name, i + 1, str(adapters[name]))
            out[name] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, False, lora_request=req)
            ]
        out[""] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, False)]
    return prompts, out


def _ids(client, prompt, lora):
    r = client.generate(
        token_ids=prompt,
        max_tokens=MAX_NEW,
        temperature=0.0,
        ignore_eos=True,
        return_token_ids=True,
        lora=lora,
    )
    return list(r.token_ids)


def test_load_with_streams_open_serve_unload(service, offline, adapters):
    prompts, want = offline
    assert want["late"] != want[""] and want["start"] != want[""]
    with LLMServeClient(service.target, timeout=60) as c:
        listed = c.list_adapters()
        assert [a.name for a in listed.adapters] == ["start"] and listed.max_loras == 2
        assert [_ids(c, p, "start") for p in prompts] == want["start"]
        # Streams open (base and adapter) while an adapter is loaded at run time.
        streams = [
            c.generate_stream(token_ids=prompts[0], max_tokens=600, ignore_eos=True, lora=lora)
            for lora in ("", "start")
        ]
        firsts = [next(s) for s in streams]
        info = c.load_adapter("late", str(adapters["late"]))
        assert (info.name, info.rank) == ("late", 16) and "down_proj" in info.target_modules
        assert [_ids(c, p, "late") for p in prompts] == want["late"]
        assert [_ids(c, p, "") for p in prompts] == want[""]
        for first, s in zip(firsts, streams, strict=True):
            rest = list(s)
            assert first.index == 0 and rest[-1].finish_reason, "a stream open during the load broke"
        c.unload_adapter("late")
        assert [a.name for a in c.list_adapters().adapters] == ["start"]
        with pytest.raises(grpc.RpcError) as e:
            _ids(c, prompts[0], "late")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'late'" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.unload_adapter("late")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert_engine_clean(service)


@pytest.mark.parametrize(
    "name,path_key,why",
    [
        ("bad", "missing", "does not exist"),
        ("bad", "wide", "rank 32, above max_lora_rank 16"),
        ("", "start", "name: must not be empty"),
    ],
)
def test_failed_load_is_invalid_argument_and_changes_nothing(
    service, adapters, tmp_path, name, path_key, why
):
    path = tmp_path / "nowhere" if path_key == "missing" else adapters[path_key]
    with LLMServeClient(service.target, timeout=60) as c:
        before = [a.name for a in c.list_adapters().adapters]
        with pytest.raises(grpc.RpcError) as e:
            c.load_adapter(name, str(path))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
        assert [a.name for a in c.list_adapters().adapters] == before


def test_lora_requests_info_metric(service):
    """The family as vLLM serves it, from the engine's heartbeat (figures while busy: the unit test
    in tests/test_lora_units.py; the engine's running/waiting names: tests/test_lora.py)."""
    port = metrics_port(service)
    key = "vllm:lora_requests_info{max_lora=2,running_lora_adapters=,waiting_lora_adapters=}"
    s = wait_for(lambda: (lambda s: s if key in s else None)(scrape(port)), 10.0, "no lora_requests_info")
    assert abs(s[key] - time.time()) < 60  # the time of the figures


def test_openai_model_field_names_the_adapter(service, offline):
    """As vLLM: the OpenAI API's ``model`` is the served model or a loaded adapter's name."""
    import httpx

    prompts, want = offline
    url = service.http_url + "/v1/completions"
    body = dict(
        prompt=prompts[0], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, return_token_ids=True
    )
    with LLMServeClient(service.target, timeout=60) as c:
        via_grpc = _ids(c, prompts[0], "start")
    assert via_grpc == want["start"][0]
    with httpx.Client(timeout=60) as h:
        r = h.post(url, json=dict(body, model="start"))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "start"
        text_adapter = r.json()["choices"][0]["text"]
        base = h.post(url, json=body).json()["choices"][0]["text"]
        assert text_adapter != base
        missing = h.post(url, json=dict(body, model="nope"))
        assert missing.status_code == 404 and "nope" in missing.text
