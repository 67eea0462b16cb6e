"""The Ollama API's translation (gateway/ollama_api.py) without a server: options onto the OpenAI
body's fields, messages with tool calls and results, violation names, and the reply objects built
from stream messages (the real client against a real server: tests/test_ollama_embeddings_service.py)."""

from __future__ import annotations

import json

import pytest

from gateway.errors import RequestError
from gateway.limits import Limits
from gateway.ollama_api import _Reply, chat_body, ollama_field, openai_messages, openai_options
from gateway.openai_protocol import chat_request
from llmserve_proto.llmserve.v1 import generation_pb2 as pb


def test_options_map_onto_the_generation_fields():
    got = openai_options(
        {"options": {"num_predict": 7, "repeat_penalty": 1.2, "stop": ["\n"], "num_ctx": 99}}
    )
    assert got == {
        "temperature": 0.8,  # Ollama's defaults where unset
        "top_k": 40,
        "top_p": 0.9,
        "max_tokens": 7,
        "repetition_penalty": 1.2,
        "stop": ["\n"],
    }
    assert "max_tokens" not in openai_options({"options": {"num_predict": -1}})
    assert openai_options({"format": "json"})["response_format"] == {"type": "json_object"}
    schema = {"type": "object"}
    assert openai_options({"format": schema})["response_format"]["json_schema"]["schema"] == schema
    req = chat_body(
        {"messages": [{"role": "user", "content": "x"}], "options": {"seed": 3, "top_k": 5}}, "", Limits()
    )
    assert (req.seed, req.top_k, req.temperature, req.HasField("max_tokens")) == (
        3,
        5,
        pytest.approx(0.8),
        False,
    )
    for body, field in [
        ({"options": {"mirostat": 1}}, "options.mirostat"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"format": "yaml"}, "format"),
        ({"options": []}, "options"),
    ]:
        with pytest.raises(RequestError) as e:
            openai_options(body)
        assert e.value.violations[0].field == field


def test_violations_are_named_as_the_ollama_client_spells_them():
    assert ollama_field("max_tokens") == "options.num_predict"
    assert ollama_field("temperature") == "options.temperature"
    assert ollama_field("stop[2]") == "options.stop[2]"
    assert ollama_field("repetition_penalty") == "options.repeat_penalty"
    assert ollama_field("response_format.json_schema.schema") == "format.json_schema.schema"
    assert ollama_field("chat.messages[1].content") == "messages[1].content"
    assert ollama_field("messages[0].role") == "messages[0].role"
    assert ollama_field("tool_choice") == "tools"
    with pytest.raises(RequestError) as e:
        chat_body(
            {"messages": [{"role": "user", "content": "x"}], "options": {"top_p": "high"}}, "", Limits()
        )
    assert e.value.violations[0].field == "options.top_p"


def test_tool_calls_and_results_become_openai_messages():
    out = openai_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "18C", "tool_name": "w"},
        ]
    )
    call = out[1]["tool_calls"][0]
    assert call["function"] == {"name": "w", "arguments": '{"city": "Paris"}'} and call["id"]
    assert out[2] == {"role": "tool", "content": "18C", "name": "w"}
    with pytest.raises(RequestError) as e:
        openai_messages([{"role": "user", "content": "x", "images": ["aGk="]}])
    assert e.value.violations[0].field == "messages[0].images"


def test_an_ollama_chat_is_the_request_its_openai_twin_reads_to():
    tool = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    ollama_body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "w", "arguments": {"c": 1}}}],
            },
            {"role": "tool", "content": "18C", "tool_name": "w"},
        ],
        "tools": [tool],
        "format": "json",
        "options": {"temperature": 0.2, "num_predict": 5, "stop": ["x"], "seed": 1},
    }
    openai_body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1_0", "type": "function", "function": {"name": "w", "arguments": '{"c": 1}'}}
                ],
            },
            {"role": "tool", "content": "18C", "name": "w"},
        ],
        "tools": [tool],
        "response_format": {"type": "json_object"},
        "temperature": 0.2,
        "top_k": 40,
        "top_p": 0.9,
        "max_tokens": 5,
        "stop": ["x"],
        "seed": 1,
    }
    assert chat_body(ollama_body, "m", Limits()) == chat_request(openai_body, Limits())


def _msg(text="", finish=0, calls=(), prompt=0, completion=0) -> pb.GenerateResponse:
    m = pb.GenerateResponse(text=text, finish_reason=finish)
    for c in calls:
        m.tool_calls.add(**c)
    if finish:
        m.usage.prompt_tokens, m.usage.completion_tokens = prompt, completion
    return m


def test_replies_stream_pieces_and_end_with_counts_and_calls():
    messages = [
        _msg("Hel"),
        _msg(calls=[{"index": 0, "id": "c0", "name": "w", "arguments": '{"city": '}]),
        _msg("lo", calls=[{"index": 0, "arguments": '"Paris"}'}]),
        _msg(finish=pb.FINISH_REASON_TOOL_CALLS, prompt=9, completion=4),
    ]
    streamed = _Reply(chat=True, model="m", stream=True)
    chunks = [streamed.add(m) for m in messages]
    assert [c["message"]["content"] if c else None for c in chunks] == ["Hel", None, "lo", None]
    last = streamed.final()
    assert last["done"] and last["done_reason"] == "stop" and last["message"]["content"] == ""
    assert last["message"]["tool_calls"] == [{"function": {"name": "w", "arguments": {"city": "Paris"}}}]
    assert (last["prompt_eval_count"], last["eval_count"]) == (9, 4)
    assert all(isinstance(last[k], int) for k in ("total_duration", "prompt_eval_duration", "eval_duration"))
    whole = _Reply(chat=False, model="m", stream=False)
    assert all(whole.add(m) is None for m in messages)
    out = whole.final()
    assert out["response"] == "Hello" and "message" not in out and json.dumps(out)


def test_think_false_hides_the_thinking_of_a_model_that_thinks():
    from gateway.ollama_api import _Reply, _think
    from llmserve_proto.llmserve.v1 import generation_pb2 as pb

    assert _think(None, "m", True) is True and _think(False, "m", True) is False
    assert _think(True, "m", True) is True and _think(False, "m", False) is False
    for stream in (True, False):
        reply = _Reply(chat=True, model="m", stream=stream, thinking=False)
        chunks = [
            reply.add(pb.GenerateResponse(reasoning_content="hmm")),
            reply.add(pb.GenerateResponse(text="Hi")),
        ]
        last = reply.final()
        shown = [c for c in chunks if c is not None]
        assert all("thinking" not in c["message"] for c in [*shown, last])
        assert (shown[0]["message"]["content"] if stream else last["message"]["content"]) == "Hi"
        assert len(shown) == (1 if stream else 0)  # the thought alone is no chunk


# A chat template with Qwen3's thinking switch (the generation prompt's part of it, in this test's words).
SWITCHED = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def test_think_is_passed_to_a_template_that_has_the_switch():
    """think true/false sets the chat's enable_thinking where the template has the switch; unset,
    or a template without it, or a raw prompt: nothing is passed."""
    from gateway.ollama_api import generate_body, switch_thinking

    def chat(think, switch):
        req = chat_body({"messages": [{"role": "user", "content": "hi"}]}, "m", Limits())
        switch_thinking(req, think, switch)
        return req.chat.enable_thinking if req.chat.HasField("enable_thinking") else None

    assert (chat(False, True), chat(True, True), chat(None, True)) == (False, True, None)
    assert chat(False, False) is None
    req = generate_body({"prompt": "hi"}, "m", Limits())
    switch_thinking(req, False, True)
    assert req.chat.enable_thinking is False
    raw = generate_body({"prompt": "hi", "raw": True}, "m", Limits())
    switch_thinking(raw, False, True)
    assert raw.WhichOneof("prompt") == "text"


def test_enable_thinking_reaches_the_template_in_process_and_in_a_worker():
    """The tokenizer renders the switch (its ids equal the rendered text's), the worker protocol
    carries it, and a template without the switch is told apart from one with it."""
    from transformers import AutoTokenizer

    from llmserve_proto.tokenizer.v1 import tokenizer_pb2 as tpb
    from tests.conftest import shared_tokenizer
    from tokenizer_svc.tokenizer import Tokenizer, load_tokenizer
    from tokenizer_svc.worker import handle

    hf = AutoTokenizer.from_pretrained(str(shared_tokenizer("qwen2")))
    tok = Tokenizer(hf, chat_template=SWITCHED)
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.render_chat(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = off[: -len("<think>\n\n</think>\n\n")]
    assert tok.render_chat(msgs, enable_thinking=True) == tok.render_chat(msgs) == plain
    text = hf.apply_chat_template(
        msgs, chat_template=SWITCHED, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    expected = hf(text, add_special_tokens=False)["input_ids"]  # HF's own reading, not ours
    assert tok.apply_chat_template(msgs, enable_thinking=False) == list(expected)
    request = tpb.WorkerRequest(chat=tpb.ChatRequest(add_generation_prompt=True, enable_thinking=False))
    request.chat.messages.add(role="user", content="hi")
    assert list(handle(tok, request).token_ids.ids) == list(expected)
    assert tok.has_thinking_switch
    assert not load_tokenizer(shared_tokenizer("qwen2")).has_thinking_switch
