"""Do long prompts being tokenized stall the streams that are running? With and without workers.

    python -m benchmarks.tokenizer_workers [--quick]

The default model (a real tokenizer) serves 16 streams; while they run, 32k-character prompts
arrive (Tokenize calls, so that the engine's work stays the same in both runs and only the
tokenizing differs). Measured: p99 inter-token latency of the 16 streams, with
``--tokenizer-workers 1`` (encoding in a worker process) and ``--tokenizer-workers 0``
(encoding on the gateway's event loop). Full run: each setting's service started twice in A B B A
order, two measured passes per start; the figures are the mean over the four passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.common import write_json
from benchmarks.loadgen import stream_one, summarize
from benchmarks.serving import RESULTS, default_model_dir, mean_summary
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.service_process import ServiceProcess

LONG_TEXT = ("The gateway must never let one long prompt stall the streams that are already running. " * 400)[
    :32000
]


async def measure(target: str, streams: int, output_len: int, long_every_s: float) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        reqs = [
            gen.GenerateRequest(
                text=f"stream {i} says",
                max_tokens=output_len,
                ignore_eos=True,
                temperature=0.0,
                return_token_ids=True,
            )
            for i in range(streams)
        ]
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream_one(stub, r)) for r in reqs]
        long_count = 0
        while not all(t.done() for t in tasks):
            await stub.Tokenize(gen.TokenizeRequest(text=LONG_TEXT))
            long_count += 1
            await asyncio.sleep(long_every_s)
        records = [t.result() for t in tasks]
        out = summarize(records, time.perf_counter() - start)
        out["long_prompts_tokenized"] = long_count
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "tokenizer_workers.json"))
    args = ap.parse_args(argv)
    streams, output_len = (4, 16) if args.quick else (16, 128)
    rounds, per_start = (1, 1) if args.quick else (2, 2)
    scratch = Path(tempfile.mkdtemp(prefix="llmserve-bench-"))
    try:
        model = default_model_dir(scratch)
        passes: dict[int, list] = {1: [], 0: []}
        # A B B A (full run): each service started twice, in alternating order, several passes each,
        # so that a drift of the shared machine's load falls on both alike.
        for rnd in range(rounds):
            for workers in (1, 0) if rnd % 2 == 0 else (0, 1):
                with ServiceProcess(
                    model, "--num-kv-blocks", "512", "--tokenizer-workers", str(workers)
                ) as sp:
                    asyncio.run(measure(sp.target, 2, 4, 0.05))  # warm-up
                    for _ in range(per_start):
                        passes[workers].append(asyncio.run(measure(sp.target, streams, output_len, 0.02)))
        rows = {k: mean_summary(v) for k, v in passes.items()}
        result = {
            "streams": streams,
            "output_len": output_len,
            "long_prompt_chars": len(LONG_TEXT),
            "with_workers": rows[1],
            "without_workers": rows[0],
            "load_average": os.getloadavg(),
            "passes": {"with_workers": passes[1], "without_workers": passes[0]},
            "services_started_per_setting": rounds,
            "passes_per_start": per_start,
            "itl_p99_ratio_without_over_with": rows[0]["itl_p99_ms"] / rows[1]["itl_p99_ms"],
        }
        print(
            f"tokenizer workers: {streams} streams x {output_len} tokens while {len(LONG_TEXT)}-char prompts "
            f"are tokenized back to back"
        )
        for name, r in (("1 worker", rows[1]), ("no worker", rows[0])):
            print(
                f"  {name:>9}: ITL p50 {r['itl_p50_ms']:.2f} ms, p99 {r['itl_p99_ms']:.2f} ms, "
                f"{r['long_prompts_tokenized']} long prompts tokenized, {r['output_tok_s']:.1f} tok/s"
            )
        print(f"  ITL p99 without / with workers = {result['itl_p99_ratio_without_over_with']:.2f}")
        print(f"wrote {write_json(args.out, result)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
