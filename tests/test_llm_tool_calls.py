"""``LLM.chat(..., tools=...)`` reads calls out of the reply as the server does: a random-weight model
under ``tool_choice`` required / named returns calls that parse and validate against their schemas
(``jsonschema``, an independent judge) in every parser's format; reasoning is split out with the
call grammar applied after it; bad tools and choices are ``ValueError``s naming the argument."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine_svc import LLM, SamplingParams
from tests.engine_helpers import assert_pool_whole

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
HERMES_TEMPLATE = (TEMPLATES / "tool_chat_template_hermes.jinja").read_text()
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Clock.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What's the weather in Oslo for 3 days?"}]
PARSERS = ["hermes", "llama3_json", "mistral", "pythonic"]


@pytest.fixture(scope="module")
def llms(default_model_dir):
    made: dict[str, LLM] = {}

    def get(parser: str | None, reasoning: str | None = None) -> LLM:
        key = f"{parser}/{reasoning}"
        if key not in made:
            made[key] = LLM(
                model=str(default_model_dir),
                num_kv_blocks=256,
                tool_call_parser=parser,
                reasoning_parser=reasoning,
            )
        return made[key]

    yield get
    for llm in made.values():
        assert_pool_whole(llm.engine)


def _check_calls(out, names=None, may_run_out=False):
    """Every call parses and validates; ``may_run_out``: a random model may go on adding calls
    until max_tokens (a list of calls has no end of its own), so the last one may be cut."""
    calls = out.tool_calls
    assert calls, "a required call was made"
    if may_run_out and out.finish_reason == "length":
        calls = calls[:-1]
    else:
        assert out.finish_reason == "tool_calls", out
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}|[0-9a-f]{9}", call.id)
        assert call.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_always_parse_and_validate(llms, parser, parallel):
    seeds = range(1 if parallel else 2)  # a parallel reply may run on to max_tokens: one is enough
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=160) for seed in seeds]
    outs = llms(parser).chat(
        [MESSAGES] * len(params), params, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=parallel, use_tqdm=False,
    )  # fmt: skip
    for r in outs:
        out = r.outputs[0]
        _check_calls(out, may_run_out=parallel)
        assert out.text == "" and out.reasoning_content is None
        if not parallel:
            assert len(out.tool_calls) == 1


@pytest.mark.parametrize("parser", ["hermes", "pythonic"])
def test_named_call_is_that_function(llms, parser):
    named = {"type": "function", "function": {"name": "get_time"}}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, n=2)
    out = llms(parser).chat(
        MESSAGES, params, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_choice=named, use_tqdm=False
    )[0]
    for seq in out.outputs:
        _check_calls(seq, ["get_time"])
        assert len(seq.tool_calls) == 1


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_required_call_after_the_reasoning(llms, reasoning):
    """The call grammar applies after ``</think>`` (a random model may think until max_tokens; what
    it does answer is a valid call, and the thinking is not in the text). deepseek_r1 starts in the
    thinking: a grammar applied from the first token would make a call that ends the reply inside
    the thinking (finish "stop", no call)."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120) for seed in range(4)]
    outs = llms("hermes", reasoning).chat(
        [MESSAGES] * 4, params, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_choice="required",
        use_tqdm=False,
    )  # fmt: skip
    for r in outs:
        out = r.outputs[0]
        assert "<think>" not in out.text and "</think>" not in (out.reasoning_content or "")
        if out.finish_reason == "tool_calls":
            _check_calls(out)
        else:
            assert out.finish_reason == "length" and not out.tool_calls


def test_auto_is_text_or_well_formed_calls_and_none_is_text(llms):
    llm = llms("hermes")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40) for seed in range(3)]
    for r in llm.chat([MESSAGES] * 3, params, chat_template=HERMES_TEMPLATE, tools=TOOLS, use_tqdm=False):
        out = r.outputs[0]
        assert out.finish_reason in ("stop", "length", "tool_calls")
        if out.finish_reason == "tool_calls":
            _check_calls(out)
        assert "<tool_call>" not in out.text
    plain = SamplingParams(temperature=0, max_tokens=8)
    none = llm.chat(MESSAGES, plain, chat_template=HERMES_TEMPLATE, tools=TOOLS, tool_choice="none",
                    use_tqdm=False)[0]  # fmt: skip
    raw = llm.generate(
        [llm.tokenizer.apply_chat_template(MESSAGES, True, HERMES_TEMPLATE, tools=TOOLS)],
        plain,
        use_tqdm=False,
    )[0]
    assert none.outputs[0].text == raw.outputs[0].text and none.outputs[0].tool_calls is None


def test_without_a_parser_the_reply_is_raw_text(llms):
    out = llms(None).chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=4), chat_template=HERMES_TEMPLATE, tools=TOOLS,
        use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    assert out.tool_calls is None and out.reasoning_content is None


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         r"tools\[0\]\.function\.parameters"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"tools\[0\]\.function\.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, r"tools\[1\]\.function\.name"),
        ({"tools": [{"type": "nope"}]}, r"tools\[0\]"),
    ],
)  # fmt: skip
def test_bad_tools_and_choices_name_the_argument(llms, kwargs, field):
    args = {"tools": TOOLS, "tool_choice": "required", **kwargs}
    with pytest.raises(ValueError, match=field):
        llms("hermes").chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False, **args)


def test_required_needs_a_parser_and_no_other_constraint(llms):
    from engine_svc.structured_outputs import StructuredOutputsParams

    with pytest.raises(ValueError, match="tool_call_parser"):
        llms(None).chat(MESSAGES, SamplingParams(max_tokens=2), tools=TOOLS, tool_choice="required")
    constrained = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="structured_outputs"):
        llms("hermes").chat(MESSAGES, constrained, tools=TOOLS, tool_choice="required")


def test_unknown_parser_names_are_refused_with_the_list(default_model_dir):
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        LLM(model=str(default_model_dir), tool_call_parser="nope")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        LLM(model=str(default_model_dir), reasoning_parser="nope")


# As Mistral's own templates do: a history's call ids must be 9 letters or digits.
MISTRAL_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' or m.tool_calls %}"
    "{%- set ids = [m.tool_call_id] if m.role == 'tool' else (m.tool_calls | map(attribute='id') | list) %}"
    "{%- for id in ids %}"
    "{%- if id | length != 9 or not id.isalnum() %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{%- endfor %}{%- endif %}"
    "{{ '[INST]' if m.role == 'user' else '' }}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}{% endfor %}"
    "{%- endfor %}"
)


@pytest.mark.parametrize("parser", PARSERS)
def test_call_ids_come_back_through_the_template(llms, parser):
    """A reply's call ids, sent back as the history's ``tool_calls`` and ``tool_call_id``, render:
    mistral's ids are the 9 letters or digits its templates insist on; the others are OpenAI's."""
    llm = llms(parser)
    out = llm.chat(
        MESSAGES, SamplingParams(temperature=1.0, seed=1, max_tokens=160), chat_template=HERMES_TEMPLATE,
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    call = out.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name,
                                                             "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]  # fmt: skip
    if parser == "mistral":
        text = llm.tokenizer.render_chat(history, True, MISTRAL_LIKE, tools=TOOLS)
        assert f"[CALL_ID]{call.id}" in text
    else:
        assert call.id.startswith("call_")
        with pytest.raises(Exception, match="length 9"):  # the check is real
            llm.tokenizer.render_chat(history, True, MISTRAL_LIKE, tools=TOOLS)
    follow = llm.chat(history, SamplingParams(temperature=0, max_tokens=2), chat_template=HERMES_TEMPLATE,
                      tools=TOOLS, tool_choice="none", use_tqdm=False)[0]  # fmt: skip
    assert '"name": "get_time"' in follow.prompt and "12:00" in follow.prompt


def test_reasoning_then_a_constrained_answer(llms):
    """``structured_outputs`` with a reasoning parser and no tools: the thinking is free, the answer
    after it is one of the choices (deepseek_r1: the reply starts in the thinking). A constraint
    applied from the first token would end the reply at once with "yes" as its reasoning and no
    answer. (A random model seldom closes its thinking by chance: the answer side is checked with
    llguidance's matcher in test_reasoning.py.)"""
    from engine_svc.structured_outputs import StructuredOutputsParams

    so = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=so) for s in range(4)]
    for r in llms(None, "deepseek_r1").chat([MESSAGES] * 4, params, use_tqdm=False):
        out = r.outputs[0]
        assert out.tool_calls is None and "</think>" not in out.reasoning_content
        if out.finish_reason == "stop":
            assert out.text in ("yes", "no"), out
        else:
            assert out.finish_reason == "length" and out.text == ""
        assert len(out.reasoning_content) > 8 and out.reasoning_content not in ("yes", "no")
