"""Token ids from gateway to engine: shared-memory rings vs plain gRPC messages, same workload.

    python -m benchmarks.transports [--quick]

Starts the service twice on the 55M dummy model (``--transport shm`` and ``--transport grpc``,
both over the engine's unix socket) and runs the same token-id workload through each: long
prompts (where the prompt ids are the bulk of the bytes) and streamed outputs. Prints each
transport's figures and the ratio shm / grpc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import write_json
from benchmarks.serving import RESULTS, dummy_model_dir, engine_args, grpc_requests, workload
from gateway.loadgen import run_load, summarize
from gateway.service_process import ServiceProcess


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "transports.json"))
    args = ap.parse_args(argv)
    prompt_len, output_len, conc, num = (64, 4, 4, 8) if args.quick else (1024, 32, 16, 64)
    kv_blocks = (conc + 2) * ((prompt_len + output_len) // 16 + 2)
    scratch = Path(tempfile.mkdtemp(prefix="llmserve-bench-"))
    try:
        model = dummy_model_dir(scratch)
        prompts = workload(num, prompt_len, output_len, seed=1)
        rows = {}
        for transport in ("shm", "grpc"):
            with ServiceProcess(
                model, *engine_args(kv_blocks), "--transport", transport, "--no-prefix-caching"
            ) as sp:
                asyncio.run(run_load(sp.target, grpc_requests(prompts[:conc], output_len), conc))  # warm-up
                rows[transport] = summarize(
                    *asyncio.run(run_load(sp.target, grpc_requests(prompts, output_len), conc))
                )
                rows[transport]["transport_reported"] = sp.transport
        ratio = rows["shm"]["request_throughput"] / rows["grpc"]["request_throughput"]
        faster = "shm" if ratio >= 1.0 else "grpc"
        result = {
            "prompt_len": prompt_len,
            "output_len": output_len,
            "concurrency": conc,
            "requests": num,
            "shm": rows["shm"],
            "grpc": rows["grpc"],
            "throughput_ratio_shm_over_grpc": ratio,
            "faster": faster,
            "load_average": os.getloadavg(),
        }
        print(
            f"transports: {num} requests, prompt {prompt_len} / output {output_len} tokens, "
            f"concurrency {conc}"
        )
        for t in ("shm", "grpc"):
            r = rows[t]
            print(
                f"  {t:>4}: {r['request_throughput']:.2f} req/s, {r['output_tok_s']:.1f} tok/s, "
                f"TTFT p50 {r['ttft_p50_ms']:.1f} ms, ITL p50 {r['itl_p50_ms']:.2f} ms, "
                f"p99 {r['itl_p99_ms']:.2f} ms"
            )
        print(f"  throughput shm / grpc = {ratio:.3f} (faster: {faster})")
        print(f"wrote {write_json(args.out, result)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
