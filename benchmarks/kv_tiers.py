"""Time to first token of one long prompt through ``llmserve serve``: cold, from the KV pool, and
from the disk tier after the server is restarted (docs/prefix-caching.md#tiers).

The prompt is the project's own Python source, cut to ``--prompt-tokens`` tokens of the served
model's tokenizer and sent as token ids (the same ids every time). Each run: start the server on a
fresh disk-tier directory, send the prompt (cold: computed), send it again (the pool holds it),
stop the server, start it again on the same directory, send it a third time (the disk tier holds
it; the pool is empty). The three answers' tokens must be equal (greedy): a restored block is the
block computed. Ratios are within this one run; writes JSON with ``--out``.

    python -m benchmarks.kv_tiers --model models/qwen2.5-coder-0.5b --prompt-tokens 6000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from engine_svc.models.model_path import resolve_model_path
from gateway.client import LLMServeClient
from tests.service_process import ServiceProcess
from tokenizer_svc.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def long_prompt(model: Path, n: int) -> list[int]:
    where = resolve_model_path(model)
    tok = load_tokenizer(where.gguf if where.is_gguf else where.root)
    text = ""
    for path in sorted((ROOT / "engine_svc").rglob("*.py")):
        text += path.read_text()
        if len(text) > 6 * n:
            break
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of source text, fewer than {n}")
    return list(ids[:n])


def first_token(sp: ServiceProcess, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    with LLMServeClient(sp.target, timeout=3600) as client:
        started = time.perf_counter()
        ttft, tokens = None, []
        for msg in client.generate_stream(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, return_token_ids=True
        ):
            if ttft is None and msg.token_ids:
                ttft = time.perf_counter() - started
            tokens += list(msg.token_ids)
    return ttft, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "qwen2.5-coder-0.5b"))
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompt = long_prompt(Path(args.model), args.prompt_tokens)
    disk = tempfile.mkdtemp(prefix="llmserve-kv-tiers-")
    # The watchdog off: on a loaded 2-core machine a deep prefill chunk may pass its default.
    serve = [
        "--torch-threads",
        str(args.threads),
        "--kv-disk-bytes",
        "4G",
        "--kv-disk-dir",
        disk,
        "--watchdog-timeout",
        "0",
    ]
    rows = {}
    with ServiceProcess(args.model, *serve, startup_timeout_s=600) as sp:
        rows["cold"] = first_token(sp, prompt, args.max_tokens)
        rows["pool"] = first_token(sp, prompt, args.max_tokens)
    on_disk = sum(f.stat().st_size for f in Path(disk).rglob("*.kv"))
    with ServiceProcess(args.model, *serve, startup_timeout_s=600) as sp:
        rows["disk after restart"] = first_token(sp, prompt, args.max_tokens)
        stats = sp.engine_stats()
    same = len({tuple(t) for _, t in rows.values()}) == 1
    result = {
        "model": args.model,
        "prompt_tokens": len(prompt),
        "threads": args.threads,
        "ttft_s": {k: round(v[0], 3) for k, v in rows.items()},
        "speedup_vs_cold": {k: round(rows["cold"][0] / v[0], 1) for k, v in rows.items()},
        "disk_tier_bytes": on_disk,
        "same_tokens": same,
        "engine_stats_after_restart": str(stats).replace("\n", "; "),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if not same:
        raise SystemExit("the answers differ: a restored block is not the block computed")


if __name__ == "__main__":
    main()
