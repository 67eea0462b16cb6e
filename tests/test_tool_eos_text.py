"""The EOS / stop token's text never reaches ``content`` or a call's arguments, also where the tool
format's markers are special tokens (llama3_json's ``<|python_tag|>``, mistral's ``[TOOL_CALLS]``) and
the output is detokenized with special tokens kept. With the real Llama 3 tokenizer (skipped where
../shared is absent): the gateway's stream path (``SequenceOutput`` then ``ChatOutput``, as a chat
request runs it) cut at every token boundary and in one piece, and ``LLM.chat`` on a random model
with that vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine_svc.sampling_params import SamplingParams
from gateway.chat_output import ChatOutput
from gateway.engine_client import EngineDelta
from gateway.sequence_output import SequenceOutput
from llmserve_proto.engine.v1 import engine_pb2 as engine_pb
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tests.conftest import TINY_ARCHS, shared_tokenizer
from tokenizer_svc.tokenizer import load_tokenizer
from tokenizer_svc.tool_parsers import get_parser

END_TEXTS = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
ARGS = '{"city": "Oslo"}'
REPLIES = {  # (parser, reply text as the model writes it) -> (content, calls)
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + "}"): ("", [ARGS]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + "}]"): ("", [ARGS]),
    ("llama3_json", "It rains in Oslo."): ("It rains in Oslo.", []),
    ("mistral", "It rains in Oslo."): ("It rains in Oslo.", []),
}


@pytest.fixture(scope="module")
def llama3():
    return load_tokenizer(shared_tokenizer("llama3"))


def _run(tok, parser_name, ids, chunks, stop_id):
    """The chat stream of ``ids`` (the last one the stop token the engine ended on) in pieces of
    ``chunks`` tokens: (content, [arguments], finish reason)."""
    params = SamplingParams(skip_special_tokens=False)  # what the server sets for these parsers
    seq = SequenceOutput("r", 0, tok, params, [tok.token_to_id("<|begin_of_text|>")], False)
    chat = ChatOutput(get_parser(parser_name), None)
    content, calls, finish = "", {}, None
    for start in range(0, len(ids), chunks):
        piece = ids[start : start + chunks]
        last = start + chunks >= len(ids)
        delta = EngineDelta(
            0, piece, engine_pb.FINISH_REASON_STOP if last else 0, stop_id if last else None, 1, 0, [], []
        )
        msg = seq.feed(delta)
        if msg is None:
            continue
        msg = chat.apply(msg)
        content += msg.text
        for c in msg.tool_calls:
            calls[c.index] = calls.get(c.index, "") + c.arguments
        finish = msg.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parser_name,reply", sorted(REPLIES))
@pytest.mark.parametrize("end", ["<|eot_id|>", "<|end_of_text|>"])
def test_stop_token_text_stays_out_of_content_and_arguments(llama3, parser_name, reply, end):
    want_content, want_calls = REPLIES[(parser_name, reply)]
    ids = llama3.encode(reply + end, add_special_tokens=False, parse_special_tokens=True)
    stop_id = llama3.token_to_id(end)
    assert ids[-1] == stop_id and stop_id in llama3.all_special_ids
    for chunks in range(1, len(ids) + 1):  # streamed at every size of piece, and whole (the last)
        content, calls, finish = _run(llama3, parser_name, ids, chunks, stop_id)
        assert (content, calls) == (want_content, want_calls), chunks
        assert finish == (pb.FINISH_REASON_TOOL_CALLS if want_calls else pb.FINISH_REASON_STOP)
        for text in (content, *calls):
            assert not any(e in text for e in END_TEXTS)


def test_include_stop_str_in_output_keeps_it(llama3):
    ids = llama3.encode("Hi<|eot_id|>", add_special_tokens=False, parse_special_tokens=True)
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    seq = SequenceOutput("r", 0, llama3, params, [], False)
    msg = seq.feed(EngineDelta(0, ids, engine_pb.FINISH_REASON_STOP, ids[-1], 1, 0, [], []))
    assert msg.text == "Hi<|eot_id|>"


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory):
    from engine_svc.models.build import build_random_model

    path = shared_tokenizer("llama3")
    tok = load_tokenizer(path)
    ends = [i for i in (tok.token_to_id(t) for t in END_TEXTS) if i is not None]
    d = build_random_model(
        tmp_path_factory.mktemp("llama3_vocab"), "llama", seed=7, vocab_size=tok.vocab_size,
        eos_token_id=ends[0], bos_token_id=tok.token_to_id("<|begin_of_text|>"), generation_eos=ends,
        **TINY_ARCHS["llama"],
    )  # fmt: skip
    for f in path.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.mark.parametrize("parser_name", ["llama3_json", "mistral"])
def test_offline_chat_never_outputs_the_end_token_text(llama3_model, parser_name):
    from engine_svc import LLM

    template = Path(__file__).resolve().parent / "chat_templates" / "tool_chat_template_llama3_json.jinja"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}]  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    llm = LLM(model=str(llama3_model), num_kv_blocks=64, tool_call_parser=parser_name)
    eot = llm.tokenizer.token_to_id("<|eot_id|>")
    ended_on_a_token = 0
    for choice in ("required", "auto"):
        # auto: a random model of this vocabulary seldom samples an end token; the bias makes it
        # end on <|eot_id|> once min_tokens allow (a required call ends when its grammar is done).
        bias = {eot: 100.0} if choice == "auto" else None
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48, min_tokens=3, logit_bias=bias)
                  for s in range(3)]  # fmt: skip
        outs = llm.chat([messages] * 3, params, chat_template=template.read_text(), tools=tools,
                        tool_choice=choice, parallel_tool_calls=False, use_tqdm=False)  # fmt: skip
        for r in outs:
            out = r.outputs[0]
            ended_on_a_token += out.stop_reason in llm.engine.spec.eos_token_ids
            for text in (out.text, *(c.arguments for c in out.tool_calls or [])):
                assert not any(e in text for e in END_TEXTS), out
            if out.finish_reason == "tool_calls":
                assert json.loads(out.tool_calls[0].arguments)["city"] is not None
    assert ended_on_a_token == 3, "the auto replies ended on <|eot_id|>: what the test is about"


def test_service_never_sends_the_end_token_text(llama3_model):
    """Through the real service and the openai client, streamed and not: replies that end on
    <|eot_id|> (biased so they do) under llama3_json, whose server turns skip_special_tokens off."""
    import openai

    from tests.service_process import ServiceProcess

    template = Path(__file__).resolve().parent / "chat_templates" / "tool_chat_template_llama3_json.jinja"
    tok = load_tokenizer(llama3_model)
    eot = tok.token_to_id("<|eot_id|>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
    args = ["--num-kv-blocks", "128", "--http-port", "0", "--served-model-name", "m", "--chat-template",
            str(template), "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]  # fmt: skip
    with ServiceProcess(llama3_model, *args) as sp:
        client = openai.OpenAI(base_url=sp.http_url + "/v1", api_key="none", max_retries=0, timeout=120)
        for seed in range(2):
            options = dict(
                model="m", messages=[{"role": "user", "content": "Weather?"}], tools=tools, seed=seed,
                temperature=1.0, max_tokens=24, extra_body={"min_tokens": 3}, logit_bias={str(eot): 100},
            )  # fmt: skip
            whole = client.chat.completions.create(**options).choices[0]
            assert whole.finish_reason == "stop" and whole.message.content
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(**options, stream=True)
            )
            assert streamed == whole.message.content
            assert not any(e in whole.message.content for e in END_TEXTS), whole.message.content
