"""Serving through the gateway vs the offline engine, and our OpenAI HTTP endpoint vs our gRPC API,
same workload, same run.

    python -m benchmarks.serving [--quick]

The 55M Llama-shaped dummy model (random weights from config.json; the default model's tokenizer
so that the gateway can detokenize) serves a token-id workload at concurrency 1, 8, 32 and 64
(4 x concurrency requests, at least 32), through the whole service (gateway + engine process,
the default gRPC transport) and through LLMEngine in this process with the same requests kept at
the same concurrency, alternating offline, service, http, http, service, offline; each path's
figures are the mean of its two passes. "service" is the gRPC GenerateStream; "http" is the same
requests through ``POST /v1/completions`` (token-id prompts, streamed SSE, ``return_token_ids``) on
the same gateway, each client in a child process of its own.
Figures: request throughput, output tokens/s, TTFT, TPOT, ITL p50/p99, and the ratios.
Targets: throughput >= 0.9x offline; added p50 ITL <= 1 ms. HTTP / gRPC is reported (not judged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.load_clients import grpc_requests, mean_summary, openai_load
from benchmarks.loadgen import RequestRecord, run_load, summarize
from engine_svc.server.cpus import torch_threads
from tests.service_process import ServiceProcess

RESULTS = Path(__file__).resolve().parent / "results"
DUMMY_SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    vocab_size=32000,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def default_model_dir(scratch: Path) -> Path:
    built = Path("models/default")
    if (built / "model.safetensors").exists():
        return built
    from engine_svc.models.build_default import build_default_model

    return build_default_model(scratch / "default")


def dummy_model_dir(scratch: Path) -> Path:
    """config.json of the 55M Llama shape (weights are made at load: --load-format dummy) plus the
    default model's tokenizer; its ids stay below 8192, the prompts here use only those."""
    return dummy_llama_dir(scratch, "llama-55m-dummy", DUMMY_SHAPE, 2048)


def dummy_llama_dir(scratch: Path, name: str, shape: dict, max_len: int) -> Path:
    """A Llama config.json of ``shape`` (weights made at load: --load-format dummy) beside the
    default model's tokenizer files."""
    out = scratch / name
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **shape,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    src = default_model_dir(scratch)
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, out / f)
    return out


def workload(num_requests: int, prompt_len: int, output_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(prompt_len)] for _ in range(num_requests)]


def offline_load(engine, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list, float]:
    """The same requests through LLMEngine directly, ``concurrency`` in flight, timed per token."""
    from engine_svc.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    todo = list(enumerate(prompts))[::-1]
    live: dict[str, RequestRecord] = {}
    records = []
    start = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            i, p = todo.pop()
            rid = f"offline-{concurrency}-{i}"
            live[rid] = RequestRecord(start=time.perf_counter())
            engine.add_request(rid, p, params)
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            rec = live[d.request_id]
            rec.token_times += [now] * len(d.new_token_ids)
            if d.finish_reason is not None:
                rec.end = now
                records.append(live.pop(d.request_id))
    return records, time.perf_counter() - start


def engine_args(num_kv_blocks: int) -> list[str]:
    return ["--load-format", "dummy", "--num-kv-blocks", str(num_kv_blocks), "--max-num-seqs", "64"]


def in_engine_thread(fn, *args):
    """Run ``fn`` on a fresh thread, as the engine server runs its loop. On a busy 2-core machine torch's
    CPU kernels called from the main thread run up to 10x slower than from another thread (OpenMP
    threads spinning against other processes), so the main thread would make a slow baseline."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn(*args)))
    t.start()
    t.join()
    return box[0]


def client_in_subprocess(
    target: str, concurrency: int, num: int, prompt_len: int, output_len: int, http: bool = False
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serving",
        "--http-client" if http else "--client",
        target,
        "--concurrency",
        str(concurrency),
        "--num-requests",
        str(num),
        "--prompt-len",
        str(prompt_len),
        "--output-len",
        str(output_len),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_client(args) -> int:
    """Child mode: warm up, then the measured run; print the summary as one JSON line."""
    c = args.concurrency[0]
    prompts = workload(args.num_requests, args.prompt_len, args.output_len, seed=c)
    if args.http_client:  # the same requests as OpenAI completions: benchmarks.peer's SSE client
        host, _, port = args.http_client.rpartition(":")
        asyncio.run(openai_load(host, int(port), "", prompts[:c], [args.output_len] * c, c))
        outs = [args.output_len] * len(prompts)
        print(json.dumps(summarize(*asyncio.run(openai_load(host, int(port), "", prompts, outs, c)))))
        return 0
    asyncio.run(run_load(args.client, grpc_requests(prompts[:c], args.output_len), c))
    print(
        json.dumps(summarize(*asyncio.run(run_load(args.client, grpc_requests(prompts, args.output_len), c))))
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run (the test uses it)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=None)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    ap.add_argument("--client", metavar="TARGET", help=argparse.SUPPRESS)  # child mode: client_in_subprocess
    ap.add_argument("--http-client", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the same, over HTTP
    ap.add_argument("--num-requests", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client or args.http_client:
        return run_client(args)
    levels = args.concurrency or ([1, 4] if args.quick else [1, 8, 32, 64])
    prompt_len, output_len = (16, 8) if args.quick else (args.prompt_len, args.output_len)
    kv_blocks = 64 * ((prompt_len + output_len) // 16 + 2)

    scratch = Path(tempfile.mkdtemp(prefix="llmserve-bench-"))
    try:
        model = dummy_model_dir(scratch)
        from engine_svc import EngineConfig, LLMEngine

        results = {
            "model": "llama-55m-dummy",
            "prompt_len": prompt_len,
            "output_len": output_len,
            "levels": [],
            "load_average_start": os.getloadavg(),
        }
        num = {c: max(2 * c, 4) if args.quick else max(4 * c, 32) for c in levels}
        repeats = 1 if args.quick else 2
        results["passes_per_path"] = repeats
        # The offline engine gets the service engine's thread count, so that the ratio is the cost
        # of the service and not of a different torch setting.
        threads = torch_threads(None)
        torch.set_num_threads(threads)
        results["torch_threads"] = threads
        engine = LLMEngine(
            EngineConfig(model=str(model), load_format="dummy", num_kv_blocks=kv_blocks, max_num_seqs=64)
        )
        with ServiceProcess(
            model,
            *engine_args(kv_blocks),
            "--tokenizer-workers",
            "1",
            "--torch-threads",
            str(threads),
            "--http-port",
            "0",
        ) as sp:
            results["transport"] = sp.transport
            # Offline and service run back to back per level, so that both see the same machine. The
            # service's client runs in a child process, as a real client would, so that its threads
            # and event loop never share a process with the offline engine being measured.
            for c in levels:
                prompts = workload(num[c], prompt_len, output_len, seed=c)
                in_engine_thread(
                    offline_load, engine, prompts[:c], output_len, c
                )  # warm-up, like the service's
                passes: dict[str, list] = {"offline": [], "service": [], "http": []}
                # Alternate, repeated: offline, service, http, http, service, offline, ... so that a
                # drift of the shared machine's load falls on every path alike.
                cycle = ["offline", "service", "http", "http", "service", "offline"]
                for path in (cycle * repeats)[: 3 * repeats]:
                    if path == "offline":
                        passes[path].append(
                            summarize(*in_engine_thread(offline_load, engine, prompts, output_len, c))
                        )
                    else:
                        target = sp.target if path == "service" else f"127.0.0.1:{sp.http_port}"
                        passes[path].append(
                            client_in_subprocess(target, c, num[c], prompt_len, output_len, path == "http")
                        )
                off, svc = mean_summary(passes["offline"]), mean_summary(passes["service"])
                http = mean_summary(passes["http"])
                results["levels"].append(
                    {
                        "concurrency": c,
                        "service": svc,
                        "offline": off,
                        "http": http,
                        "passes": passes,
                        "throughput_ratio": svc["output_tok_s"] / off["output_tok_s"],
                        "http_over_grpc_throughput": http["output_tok_s"] / svc["output_tok_s"],
                        "http_minus_grpc_itl_p50_ms": http["itl_p50_ms"] - svc["itl_p50_ms"],
                        "http_minus_grpc_ttft_p50_ms": http["ttft_p50_ms"] - svc["ttft_p50_ms"],
                        "added_itl_p50_ms": svc["itl_p50_ms"] - off["itl_p50_ms"],
                    }
                )
        results["load_average_end"] = os.getloadavg()
        print_table(results)
        print(f"wrote {write_json(args.out, results)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def print_table(results: dict) -> None:
    print(
        f"serving benchmark: {results['model']}, prompt {results['prompt_len']} / "
        f"output {results['output_len']} "
        f"tokens, transport {results['transport']}"
    )
    head = (
        f"{'conc':>4} {'path':>8} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT':>7} "
        f"{'ITL p50':>8} {'ITL p99':>8}   (ms)"
    )
    print(head)
    for row in results["levels"]:
        for path in ("service", "http", "offline"):
            r = row[path]
            print(
                f"{row['concurrency']:>4} {path:>8} {r['request_throughput']:>7.2f} "
                f"{r['output_tok_s']:>8.1f} "
                f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} {r['tpot_mean_ms']:>7.2f} "
                f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f}"
            )
        print(
            f"     throughput service/offline = {row['throughput_ratio']:.3f} (target >= 0.9), "
            f"added ITL p50 = {row['added_itl_p50_ms']:+.2f} ms (target <= 1)"
        )
        print(
            f"     HTTP/gRPC throughput = {row['http_over_grpc_throughput']:.3f}, "
            f"ITL p50 {row['http_minus_grpc_itl_p50_ms']:+.2f} ms, "
            f"TTFT p50 {row['http_minus_grpc_ttft_p50_ms']:+.2f} ms"
        )


if __name__ == "__main__":
    raise SystemExit(main())
