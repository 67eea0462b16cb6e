"""Two defects of the tool path (issue 40), on a tiny random Qwen2 with the real Qwen2 tokenizer:

- ``tool_choice: "required"`` with parallel calls at temperature 1.0: a random model writes call
  after call. The grammar closes the list after ``MAX_PARALLEL_CALLS``; a call cut by the token limit
  is never returned as a call, neither by ``LLM.chat`` nor by the gateway's stream path
  (``SequenceOutput`` then ``ChatOutput``, fed the same tokens in pieces and whole). The raw output is
  read independently (the decoded tokens) to check that the cut case really happened. (That the list
  closes: tests/test_tool_grammars.py, on the grammar itself.)
- A model whose config names no EOS id: the tokenizer's ``eos_token`` is its end (as vLLM does), so a
  grammar (llguidance needs an end token) compiles and a required call ends.
"""

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
from tokenizer_svc.tool_parsers import get_parser

TEMPLATE = Path(__file__).resolve().parent / "chat_templates" / "tool_chat_template_hermes.jinja"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]


@pytest.fixture(scope="module")
def qwen2_no_eos(tmp_path_factory):
    """A tiny random Qwen2 of the Qwen2 vocabulary whose config.json and generation_config.json
    name no eos_token_id (the tokenizer's eos_token, <|endoftext|>, is its only end)."""
    from engine_svc.models.build import build_random_model
    from tokenizer_svc.tokenizer import load_tokenizer

    src = shared_tokenizer("qwen2")
    tok = load_tokenizer(src)
    d = build_random_model(
        tmp_path_factory.mktemp("qwen2_no_eos"), "qwen2", seed=5, vocab_size=tok.vocab_size,
        eos_token_id=None, bos_token_id=None, **TINY_ARCHS["qwen2"],
    )  # fmt: skip
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        cfg.pop("eos_token_id", None)
        (d / name).write_text(json.dumps(cfg))
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def llm(qwen2_no_eos):
    from engine_svc import LLM

    return LLM(model=str(qwen2_no_eos), num_kv_blocks=256, tool_call_parser="hermes")


def test_no_eos_in_config_falls_back_to_the_tokenizers(llm):
    eos = llm.tokenizer.token_to_id("<|endoftext|>")
    assert llm.engine.spec.eos_token_ids == (eos,)
    assert llm.engine.grammars is not None  # llguidance got an end token: grammars compile


def _gateway_stream(tok, ids: list[int], finish: int, stop_id: int | None, chunk: int):
    """The gateway's chat stream of ``ids`` in pieces of ``chunk`` tokens: (calls' arguments as
    reassembled from the stream, finish reason)."""
    seq = SequenceOutput("r", 0, tok, SamplingParams(), [0], False)
    out = ChatOutput(get_parser("hermes"), None)
    calls: dict[int, str] = {}
    last = None
    for start in range(0, len(ids), chunk):
        end = start + chunk >= len(ids)
        delta = EngineDelta(
            0, ids[start : start + chunk], finish if end else 0, stop_id if end else None, 1, 0, [], []
        )
        msg = seq.feed(delta)
        if msg is None:
            continue
        msg = out.apply(msg)
        for c in msg.tool_calls:
            assert c.index not in calls or not c.name, "a call is sent once, whole"
            calls[c.index] = calls.get(c.index, "") + c.arguments
        last = msg.finish_reason or last
    return [calls[i] for i in sorted(calls)], last


def test_required_parallel_calls_cut_by_the_limit_are_not_calls(llm):
    tok = llm.tokenizer
    template = TEMPLATE.read_text()
    cut = 0
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=48) for seed in range(3)]
    outs = llm.chat([MESSAGES] * 3, params, chat_template=template, tools=TOOLS, tool_choice="required",
                    use_tqdm=False)  # fmt: skip
    for seed, r in enumerate(outs):
        out = r.outputs[0]
        raw = tok.decode(list(out.token_ids), skip_special_tokens=False)
        opened, closed = raw.count("<tool_call>"), raw.count("</tool_call>")
        if out.finish_reason == "length" and opened > closed:
            cut += 1  # the reader's own count: the last call is unfinished in the raw output
        for c in out.tool_calls:
            assert isinstance(json.loads(c.arguments), dict), (seed, c)
        assert len(out.tool_calls) == closed, (seed, raw)  # every finished call, no unfinished one
        length = out.finish_reason == "length"
        finish = engine_pb.FINISH_REASON_LENGTH if length else engine_pb.FINISH_REASON_STOP
        stop_id = None if length else out.token_ids[-1]
        for chunk in (1, 3, len(out.token_ids)):
            calls, last = _gateway_stream(tok, list(out.token_ids), finish, stop_id, chunk)
            assert calls == [c.arguments for c in out.tool_calls], (seed, chunk)
            for a in calls:
                assert isinstance(json.loads(a), dict)
            if finish == engine_pb.FINISH_REASON_LENGTH:
                assert last == pb.FINISH_REASON_LENGTH
    assert cut >= 2, "the token limit cut a call on most seeds: what the test is about"
