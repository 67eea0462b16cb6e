"""The OpenAI layer's translation of request bodies, read back from the GenerateRequest it makes:
every form the API allows for a field must arrive (a form dropped silently is a wrong answer the
client cannot see)."""

from __future__ import annotations

import pytest

from gateway.errors import RequestError
from gateway.limits import Limits
from gateway.openai_protocol import chat_request, completion_requests

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stop, expected", [("END", ["END"]), (["a", "bc"], ["a", "bc"]), (None, [])])
def test_stop_as_a_string_or_a_list_reaches_the_request(stop, expected):
    body = {"model": "m", "prompt": "hello", **({} if stop is None else {"stop": stop})}
    (req,) = completion_requests(body, Limits())
    assert list(req.stop) == expected
    req = chat_request({"model": "m", "messages": CHAT, **({} if stop is None else {"stop": stop})}, Limits())
    assert list(req.stop) == expected


@pytest.mark.parametrize("stop", [7, ["a", 3], {"x": 1}])
def test_stop_of_another_type_is_refused_by_name(stop):
    with pytest.raises(RequestError) as e:
        completion_requests({"model": "m", "prompt": "hello", "stop": stop}, Limits())
    assert "stop" in str(e.value)
