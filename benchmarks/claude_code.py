"""Claude Code itself, in its full default mode, against ``llmserve serve`` at the server's defaults.

    python -m benchmarks.claude_code --model models/qwen2.5-coder-0.5b [--turns 3]

Claude Code (``@anthropic-ai/claude-code`` from npm, installed into tests/node by ``make test``)
runs headless (``claude -p``) with its own system prompt and tools, ``ANTHROPIC_BASE_URL`` at a
server started with no option beyond its address (tools, context, threads, watchdog: defaults), in
a scratch project holding one small file. Turn 1 asks about the file, later turns ``--continue`` the
session. Per turn: Claude Code's exit status and wall time, and from the server's log the requests
it made with their prompt tokens, cached prompt tokens and time to first token. A 503 or a refusal
shows as a non-zero exit status and a request outcome other than ``stop`` / ``length``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import RESULTS_DIR, write_result

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "tests" / "node" / "node_modules" / ".bin" / "claude"
PROMPTS = (
    "What does the function in hello.py do? Answer in one sentence.",
    "Which argument does it take? One word.",
    "Say the word done.",
)
FINISHED = re.compile(r"finished outcome=\"(\w+)\" (.*)")


def _requests(log: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        m = FINISHED.search(line)
        if m:
            fields = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
            out.append({"outcome": m.group(1), **{k: float(v) for k, v in fields.items()}})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a GGUF file or a folder with one")
    ap.add_argument("--turns", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if not CLAUDE.exists():
        raise SystemExit(f"Claude Code is not installed: `cd {CLAUDE.parents[2]} && npm ci` installs it")
    from tests.service_process import ServiceProcess

    gguf = args.model if args.model.is_file() else next(args.model.glob("*.gguf"))
    result: dict = {"model": gguf.name, "turns": []}
    with ServiceProcess(gguf, "--http-port", "0", startup_timeout_s=1800) as sp:
        name = httpx.get(sp.http_url + "/v1/models").json()["data"][0]["id"]
        home, work = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
        (work / "hello.py").write_text("def greet(name):\n    return 'Hello, ' + name\n")
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),  # no user settings, no keychain, no history
            "ANTHROPIC_BASE_URL": sp.http_url,
            "ANTHROPIC_API_KEY": "sk-local",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "API_TIMEOUT_MS": str(4 * 3600 * 1000),  # a cold CPU prefill of its ~12-19k-token prompt
        }
        seen = 0
        for turn, prompt in enumerate(PROMPTS[: args.turns], start=1):
            cmd = [str(CLAUDE), "-p", prompt, "--model", name, *(["--continue"] if turn > 1 else [])]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=4 * 3600)
            wall = time.perf_counter() - t0
            reqs = _requests(sp.log_tail(1 << 26))
            new, seen = reqs[seen:], len(reqs)
            answer = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            result["turns"].append(
                {
                    "turn": turn,
                    "exit": out.returncode,
                    "wall_s": wall,
                    "answer": answer[:300],
                    "requests": new,
                }
            )
            main_req = max(new, key=lambda r: r.get("prompt_tokens", 0), default={})
            print(
                f"turn {turn}: exit {out.returncode}, {wall:.1f}s, {len(new)} requests "
                f"({', '.join(r['outcome'] for r in new)}); "
                f"largest prompt {main_req.get('prompt_tokens', 0):.0f} "
                f"tokens, ttft {main_req.get('ttft_s', float('nan')):.2f}s: {answer[:120]!r}",
                flush=True,
            )
    print(write_result(f"claude_code_{gguf.stem}", result, args.results_dir))
    return result


if __name__ == "__main__":
    main()
