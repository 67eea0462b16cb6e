"""Structured logs: the request id on every line of a request, across tasks; prompts only on request."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from engine_svc.rpc.log_setup import request_scope, setup_logging
from gateway.prompt_log import PromptLogPolicy


@pytest.fixture
def captured():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    yield buf
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


def test_json_lines_carry_the_request_id_of_their_own_task(captured):
    setup_logging("DEBUG", "json", "gateway", stream=captured)
    log = logging.getLogger("gateway.test")

    async def request(rid: str) -> None:
        with request_scope(rid):
            log.info("start", extra={"fields": {"n": 1}})
            await asyncio.sleep(0.01)  # the other request logs in between
            log.info("end", extra={"outcome": "length"})

    async def main():
        await asyncio.gather(request("r-1"), request("r-2"))
        log.info("no request here")

    asyncio.run(main())
    lines = [json.loads(x) for x in captured.getvalue().splitlines()]
    lines = [x for x in lines if x["logger"] == "gateway.test"]
    by_msg = [(x["msg"], x.get("request_id")) for x in lines]
    assert sorted(by_msg[:4]) == [("end", "r-1"), ("end", "r-2"), ("start", "r-1"), ("start", "r-2")]
    assert by_msg[4] == ("no request here", None)
    assert lines[0]["n"] == 1 and lines[0]["process"] == "gateway" and lines[0]["level"] == "info"
    assert {x.get("outcome") for x in lines if x["msg"] == "end"} == {"length"}


def test_text_lines_show_the_request_id_and_fields(captured):
    setup_logging("INFO", "text", "engine", stream=captured)
    with request_scope("abc"):
        logging.getLogger("x").warning("refused", extra={"fields": {"code": "INVALID_ARGUMENT"}})
    logging.getLogger("x").info("explicit", extra={"request_id": "given"})
    first, second = captured.getvalue().splitlines()
    assert 'request_id=abc refused code="INVALID_ARGUMENT"' in first and "engine[" in first
    assert "request_id=given explicit" in second
    with pytest.raises(ValueError):
        setup_logging("INFO", "yaml")


def test_prompt_policy_gives_sizes_by_default_and_text_only_when_asked():
    secret = "my password is hunter2"
    chat = [{"role": "user", "content": secret}]
    quiet = PromptLogPolicy(False).fields(text=secret, num_tokens=6)
    assert quiet == {"prompt_chars": len(secret), "prompt_tokens": 6}
    assert secret not in json.dumps(PromptLogPolicy(False).fields(chat=chat))
    loud = PromptLogPolicy(True)
    assert loud.fields(text=secret)["prompt"] == secret
    assert loud.fields(chat=chat)["chat"] == chat


def test_a_request_scope_closed_in_another_context_does_not_raise(captured):
    """grpc.aio may finalize a cancelled handler's async generator from another task."""
    import contextvars

    setup_logging("INFO", "json", "gateway", stream=captured)

    async def handler():
        with request_scope("r-x"):
            yield 1
            yield 2

    async def main():
        gen = handler()
        assert await gen.__anext__() == 1
        await asyncio.get_running_loop().create_task(gen.aclose(), context=contextvars.Context())

    asyncio.run(main())
