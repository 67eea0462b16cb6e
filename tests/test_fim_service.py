"""Fill-in-the-middle through the real service, spoken by real clients: the ``openai`` SDK's
completions with ``suffix``, the ``ollama`` client's ``generate`` with ``suffix``, httpx on
llama.cpp's ``/infill`` (whole and streamed), and gRPC ``Generate`` with ``infill``.

On Qwen2.5-Coder 0.5B (a catalogue GGUF; skipped with the reason where absent): the prompt each door
builds is the model card's layout (tokenizer_svc/fim.py, checked against the ids the service reports),
and the greedy output is bit-equal to the same prompt through ``LLM.generate`` (the FIM path is a
prompt, not a second engine). On the default model (SmolLM2, no FIM tokens): every door answers
with the error that names what is missing. A client that leaves stops its /infill request.
"""

from __future__ import annotations

import json
import socket

import grpc
import httpx
import ollama
import openai
import pytest

from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import catalogue_model_path
from tests.fault_helpers import assert_engine_clean, wait_for
from tests.service_process import ServiceProcess

CODER = "qwen2.5-coder-0.5b"
PREFIX = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
SUFFIX = "\n\n\nprint(fibonacci(10))\n"
FILES = [("util.py", "def add(a, b):\n    return a + b\n")]
N = 24


@pytest.fixture(scope="module")
def coder():
    path = catalogue_model_path(CODER)
    args = ["--http-port", "0", "--served-model-name", "coder", "--max-model-len", "4096"]
    with ServiceProcess(path, *args, startup_timeout_s=600) as sp:
        yield sp, path


@pytest.fixture(scope="module")
def coder_fim(coder):
    from tokenizer_svc.fim import find_fim
    from tokenizer_svc.tokenizer import load_tokenizer

    tok = load_tokenizer(coder[1])
    spec = find_fim(tok.token_to_id, tok.bos_token_id, None, tok.convert_ids_to_tokens)
    return tok, spec


@pytest.fixture(scope="module")
def offline(coder):
    """The same prompt through the offline API: the reference the service must equal."""
    from engine_svc.llm import LLM
    from engine_svc.sampling_params import SamplingParams

    llm = LLM(model=str(coder[1]), max_model_len=4096)

    def generate(ids: list[int], stops) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=N, stop_token_ids=list(stops))
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    yield generate
    llm.shutdown()


def _expected_prompt(coder_fim, prefix, suffix, files=(), path="", order=""):
    """The prompt the service must build: the server's default order (--fim-order) unless named."""
    from tokenizer_svc.fim import DEFAULT_FIM_ORDER, FimInput, build_ids

    tok, spec = coder_fim
    enc = lambda t: tok.encode(t, add_special_tokens=False, parse_special_tokens=False)  # noqa: E731
    return build_ids(spec, FimInput(prefix, suffix, list(files), path, order=order or DEFAULT_FIM_ORDER), enc)


def test_openai_completions_with_suffix_is_the_fim_prompt_and_the_offline_output(coder, coder_fim, offline):
    sp, _ = coder
    oai = openai.OpenAI(base_url=sp.http_url + "/v1", api_key="none", max_retries=0, timeout=600)
    r = oai.completions.create(
        model="coder",
        prompt=PREFIX,
        suffix=SUFFIX,
        max_tokens=N,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    prompt = _expected_prompt(coder_fim, PREFIX, SUFFIX)
    assert choice.model_extra["prompt_token_ids"] == prompt
    tokens = choice.model_extra["token_ids"]
    expected = offline(prompt, coder_fim[1].end_ids)
    assert tokens == expected
    assert "fibonacci(n - 1)" in choice.text  # the model does fill the middle
    # streamed: the same text
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(
            model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=N, temperature=0, stream=True
        )
    )
    assert streamed == choice.text


def test_ollama_generate_with_suffix(coder, coder_fim, offline):
    sp, _ = coder
    oll = ollama.Client(host=sp.http_url, timeout=600)
    r = oll.generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": N}
    )
    tok, spec = coder_fim
    expected = offline(_expected_prompt(coder_fim, PREFIX, SUFFIX), spec.end_ids)
    assert r.response == tok.decode(expected)
    assert r.prompt_eval_count == len(_expected_prompt(coder_fim, PREFIX, SUFFIX))
    pieces = [c.response for c in oll.generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": N}, stream=True
    )]  # fmt: skip
    assert "".join(pieces) == r.response
    spm = oll.generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX,
        options={"temperature": 0, "num_predict": N, "fim_order": "spm"},
    )  # fmt: skip
    spm_prompt = _expected_prompt(coder_fim, PREFIX, SUFFIX, order="spm")
    assert spm.prompt_eval_count == len(spm_prompt)
    assert spm.response == tok.decode(offline(spm_prompt, spec.end_ids))


def test_infill_with_extra_files_whole_and_streamed(coder, coder_fim, offline):
    sp, _ = coder
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": f, "text": t} for f, t in FILES],
        "n_predict": N,
        "temperature": 0,
        "return_tokens": True,
    }
    r = httpx.post(sp.http_url + "/infill", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = _expected_prompt(coder_fim, PREFIX, SUFFIX, FILES)
    assert out["tokens"] == offline(prompt, coder_fim[1].end_ids)
    assert out["stop"] is True and out["tokens_evaluated"] == len(prompt)
    # the model card's repository layout, the current file's line included (no names given:
    # llama-server's)
    tok = coder_fim[0]
    card = "<|repo_name|>myproject\n" + "".join(f"<|file_sep|>{f}\n{t}\n" for f, t in FILES)
    card += f"<|file_sep|>filename\n<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    assert prompt == tok.encode(card, add_special_tokens=False, parse_special_tokens=True)
    assert out["stop_type"] in ("eos", "limit") and out["tokens_predicted"] == len(out["tokens"])
    # the second identical request reuses the cached prompt (all but the block being written)
    again = httpx.post(sp.http_url + "/infill", json=body, timeout=600).json()
    assert again["tokens"] == out["tokens"] and again["tokens_cached"] >= len(prompt) - 16
    # the layouts on request: PSM's prompt, and a keystroke after SPM's recomputes only its tail
    psm = httpx.post(sp.http_url + "/infill", json={**body, "fim_order": "psm"}, timeout=600).json()
    psm_prompt = _expected_prompt(coder_fim, PREFIX, SUFFIX, FILES, order="psm")
    assert psm["tokens"] == offline(psm_prompt, coder_fim[1].end_ids)
    assert psm["tokens_evaluated"] == len(psm_prompt)
    httpx.post(sp.http_url + "/infill", json={**body, "fim_order": "spm"}, timeout=600).raise_for_status()
    typed = {**body, "input_prefix": PREFIX + "fib", "fim_order": "spm"}
    key = httpx.post(sp.http_url + "/infill", json=typed, timeout=600).json()
    before = _expected_prompt(coder_fim, PREFIX, SUFFIX, FILES, order="spm")
    spm_prompt = _expected_prompt(coder_fim, PREFIX + "fib", SUFFIX, FILES, order="spm")
    assert key["tokens"] == offline(spm_prompt, coder_fim[1].end_ids)
    changed = len(spm_prompt) - next(
        i for i, (a, b) in enumerate(zip(before, spm_prompt, strict=False)) if a != b
    )
    assert changed <= 4
    assert key["tokens_evaluated"] - key["tokens_cached"] <= changed + 16  # + the partial block
    text, last = "", None
    with httpx.stream("POST", sp.http_url + "/infill", json={**body, "stream": True}, timeout=600) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                text += event["content"]
                last = event
    assert text == out["content"] and last["stop"] is True


def test_grpc_generate_with_infill(coder, coder_fim, offline):
    sp, _ = coder
    req = pb.GenerateRequest(
        infill=pb.Infill(
            prefix=PREFIX, suffix=SUFFIX, files=[pb.InfillFile(path=p, text=t) for p, t in FILES]
        ),
        max_tokens=N,
        temperature=0,
        return_token_ids=True,
    )
    with grpc.insecure_channel(sp.target) as ch:
        r = pb_grpc.GenerationStub(ch).Generate(req, timeout=600)
    prompt = _expected_prompt(coder_fim, PREFIX, SUFFIX, FILES)
    assert list(r.token_ids) == offline(prompt, coder_fim[1].end_ids)
    assert r.usage.prompt_tokens == len(prompt)
    req.infill.order = pb.FIM_ORDER_SPM  # the suffix first, on request
    with grpc.insecure_channel(sp.target) as ch:
        r = pb_grpc.GenerationStub(ch).Generate(req, timeout=600)
    spm = _expected_prompt(coder_fim, PREFIX, SUFFIX, FILES, order="spm")
    assert list(r.token_ids) == offline(spm, coder_fim[1].end_ids) and r.usage.prompt_tokens == len(spm)


def test_bad_infill_inputs_name_their_fields(coder):
    sp, _ = coder
    url = sp.http_url + "/infill"
    cases = [
        ({"input_prefix": 3}, "input_prefix"),
        ({"input_prefix": "a", "input_extra": [{"filename": "x"}]}, "input_extra[0]"),
        ({"input_prefix": "a", "n_predict": 0}, "n_predict"),
        ({"input_prefix": "", "input_suffix": ""}, "input_prefix"),
        (
            {"input_prefix": "a", "input_extra": [{"filename": "a\nb", "text": "t"}]},
            "input_extra[0].filename",
        ),
        ({"input_prefix": "a", "fim_order": "mps"}, "fim_order"),
    ]
    for body, field in cases:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"].startswith(field + ":"), r.text
    oai = openai.OpenAI(base_url=sp.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="coder", prompt=[1, 2, 3], suffix="x", max_tokens=2)
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="coder", prompt="a", max_tokens=2, extra_body={"fim_order": "spm"})
    assert e.value.body["param"] == "fim_order" and "suffix" in e.value.body["message"]


def test_a_client_that_leaves_stops_its_infill(coder):
    """An editor drops the previous keystroke's request by closing its connection: the engine
    request is aborted (not run to its 3000 tokens)."""
    sp, _ = coder
    body = json.dumps({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3000, "ignore_eos": True})
    cancelled = sp.log_tail(1 << 20).count('outcome="cancelled"')
    host, port = sp.http_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /infill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    wait_for(lambda: sp.engine_stats().load.num_running == 1, 120, "the infill request did not start")
    sock.close()
    assert_engine_clean(sp, within_s=60)
    # ended by the client leaving, not by running out its tokens
    wait_for(
        lambda: sp.log_tail(1 << 20).count('outcome="cancelled"') > cancelled, 60, "no cancelled outcome"
    )


# --- editor options: where a completion ends, and the next keystroke superseding this one -------------

# A function body (the cursor at its indentation, 4) with a definition after it in the suffix: greedy,
# the model writes the body, then leaves it (``\n\n\nif __name__``...): the block's right end.
BODY_PREFIX = "import os\n\n\ndef list_files(path):\n    "
BODY_SUFFIX = "\n\n\ndef main():\n    print(list_files('.'))\n"


def test_stop_at_line_and_block_end_where_the_code_does_at_every_door(coder):
    from tokenizer_svc.code_stop import BLOCK, LINE, CodeStop

    sp, _ = coder
    base = {"input_prefix": BODY_PREFIX, "input_suffix": BODY_SUFFIX, "n_predict": 64, "temperature": 0}
    whole = httpx.post(sp.http_url + "/infill", json=base, timeout=600).json()["content"]
    # the known stop points in this output: the first line, and the body before the dedented code
    line = whole[: whole.index("\n")]
    block = whole[: whole.index("\n\n\nif __name__")]
    assert line and "\n    " in block and len(block) < len(whole.rstrip())  # each rule has work to do

    def rule(name: str) -> str:  # the rule's own verdict on the whole output, for the same cut
        stop = CodeStop(name, 4)
        return stop.push(whole).text

    assert (rule(LINE), rule(BLOCK)) == (line, block)

    r = httpx.post(sp.http_url + "/infill", json={**base, "stop_at": "line"}, timeout=600).json()
    assert (r["content"], r["stop_type"]) == (line, "limit")
    r = httpx.post(sp.http_url + "/infill", json={**base, "n_indent": 4}, timeout=600).json()  # llama.cpp's
    assert (r["content"], r["stop_type"]) == (block, "limit")
    streamed = ""
    with httpx.stream(
        "POST", sp.http_url + "/infill", json={**base, "stop_at": "block", "stream": True}, timeout=600
    ) as s:
        for event in s.iter_lines():
            if event.startswith("data: "):
                streamed += json.loads(event[6:])["content"]
    assert streamed == block

    oai = openai.OpenAI(base_url=sp.http_url + "/v1", api_key="none", max_retries=0, timeout=600)
    r = oai.completions.create(
        model="coder", prompt=BODY_PREFIX, suffix=BODY_SUFFIX, max_tokens=64, temperature=0,
        extra_body={"stop_at": "block"},
    )  # fmt: skip
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (block, "stop", "block")

    oll = ollama.Client(host=sp.http_url, timeout=600)
    r = oll.generate(
        model="coder", prompt=BODY_PREFIX, suffix=BODY_SUFFIX,
        options={"temperature": 0, "num_predict": 64, "stop_at": "line"},
    )  # fmt: skip
    assert (r.response, r.done_reason) == (line, "stop")

    req = pb.GenerateRequest(
        infill=pb.Infill(prefix=BODY_PREFIX, suffix=BODY_SUFFIX),
        max_tokens=64,
        temperature=0,
        stop_at=pb.STOP_AT_BLOCK,
    )
    with grpc.insecure_channel(sp.target) as ch:
        r = pb_grpc.GenerationStub(ch).Generate(req, timeout=600)
    assert (r.text, r.finish_reason, r.stop_rule) == (block, pb.FINISH_REASON_STOP, "block")

    bad = httpx.post(sp.http_url + "/infill", json={**base, "stop_at": "word"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("stop_at:")
    assert_engine_clean(sp, within_s=60)  # each rule's end aborted its request in the engine


def test_the_next_request_with_the_same_supersede_key_cancels_the_one_in_flight(coder):
    """An editor's keystrokes, each with the same key: the newer request cancels the older at once
    (its client is told CANCELLED, the log says outcome "cancelled"); another key leaves it be."""
    import threading

    sp, _ = coder
    cancelled = sp.log_tail(1 << 20).count('outcome="cancelled"')
    first = pb.GenerateRequest(
        infill=pb.Infill(prefix=PREFIX, suffix=SUFFIX),
        max_tokens=3000,
        ignore_eos=True,
        supersede_key="editor-1",
    )
    ended: dict = {}

    def stream_first():
        with grpc.insecure_channel(sp.target) as ch:
            try:
                for _ in pb_grpc.GenerationStub(ch).GenerateStream(first, timeout=600):
                    pass
                ended["code"] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                ended["code"], ended["details"] = e.code(), e.details()

    t = threading.Thread(target=stream_first)
    t.start()
    try:
        wait_for(lambda: sp.engine_stats().load.num_running == 1, 300, "the first request did not start")
        oai = openai.OpenAI(base_url=sp.http_url + "/v1", api_key="none", max_retries=0, timeout=600)
        for key in ("editor-2", "editor-1"):  # another key first: the first request runs on
            r = oai.completions.create(
                model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=2, temperature=0,
                extra_body={"supersede_key": key},
            )  # fmt: skip
            assert r.choices[0].finish_reason in ("stop", "length")
            if key == "editor-2":
                assert "code" not in ended and sp.engine_stats().load.num_running == 1
    finally:
        t.join(600)
    assert ended["code"] == grpc.StatusCode.CANCELLED, ended
    assert "superseded" in ended["details"] and "supersede_key" in ended["details"]
    wait_for(
        lambda: sp.log_tail(1 << 20).count('outcome="cancelled"') > cancelled, 60, "no cancelled outcome"
    )
    assert_engine_clean(sp, within_s=60)


# --- a model without FIM tokens -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(default_model_dir):
    with ServiceProcess(default_model_dir, "--http-port", "0", "--served-model-name", "plain") as sp:
        yield sp


def test_a_model_without_fim_tokens_says_what_is_missing_at_every_door(plain):
    missing = "no fill-in-the-middle tokens"
    oai = openai.OpenAI(base_url=plain.http_url + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="plain", prompt="def f(", suffix=")\n", max_tokens=4)
    assert e.value.body["param"] == "suffix" and missing in e.value.body["message"]
    assert "<|fim_prefix|>" in e.value.body["message"]

    oll = ollama.Client(host=plain.http_url, timeout=120)
    with pytest.raises(ollama.ResponseError) as e:
        oll.generate(model="plain", prompt="def f(", suffix=")\n")
    assert e.value.status_code == 400 and e.value.error.startswith("suffix:") and missing in e.value.error

    r = httpx.post(
        plain.http_url + "/infill", json={"input_prefix": "def f(", "input_suffix": ")"}, timeout=120
    )
    assert r.status_code == 400 and missing in r.json()["error"]["message"]

    with grpc.insecure_channel(plain.target) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(infill=pb.Infill(prefix="def f(")), timeout=120
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and missing in e.value.details()


def test_the_docs_examples_run_as_written(coder):
    """docs/fill-in-the-middle.md's examples, one per door and one ending at its block, with this
    server's address; each completes what it is given (greedy)."""
    import contextlib
    import io
    import re
    from pathlib import Path

    sp, _ = coder
    page = Path(__file__).resolve().parents[1] / "docs" / "fill-in-the-middle.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) == 5
    for code in blocks:
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{sp.http_port}").replace(
            "127.0.0.1:50051", sp.target
        )
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(page), "exec"), {})
        # the four doors complete the Fibonacci call; the block example ends with its function body
        expected = "os.path.exists" if "stop_at" in code else "fibonacci(n - 1)"
        assert expected in out.getvalue(), (code, out.getvalue())
        if "stop_at" in code:
            assert "__main__" not in out.getvalue() and "limit" in out.getvalue()
