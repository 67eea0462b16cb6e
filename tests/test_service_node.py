"""A second language: a Node.js client built from proto/ at run time streams a generation.

Skips only where ``node`` itself is missing; with node present, `make test` has installed the npm
packages (tests/node/node_modules) and a missing package is a failure, not a skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.client import LLMServeClient
from tests.service_process import ServiceProcess

NODE_DIR = Path(__file__).resolve().parent / "node"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_client_streams_the_same_generation_as_python(default_model_dir):
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "run `make test` (or `npm ci` in tests/node) to install the Node.js packages"
    )
    prompt = "Streaming to Node.js 🚀 and 中文"
    with ServiceProcess(default_model_dir, "--num-kv-blocks", "256", "--tokenizer-workers", "0") as sp:
        out = subprocess.run(
            ["node", str(NODE_DIR / "stream_generate.js"), sp.target, prompt, "24"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        with LLMServeClient(sp.target, timeout=60) as client:
            want = client.generate(prompt, temperature=0.0, max_tokens=24, return_token_ids=True)
    assert result["token_ids"] == list(want.token_ids)
    assert result["text"] == want.text
    assert result["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert int(result["usage"]["completion_tokens"]) == len(want.token_ids)
    assert result["messages"] >= 2  # it streamed, not one message at the end
