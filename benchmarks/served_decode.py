"""Served decode against the offline engine on a real model, the same threads, one run.

    python -m benchmarks.served_decode [--model models/default] [--threads default,2]
        [--concurrency 1,16] [--tokens 128] [--rounds 2] [--transports http,grpc]

For each thread setting, the offline engine (``LLM`` in this process, ``torch.set_num_threads``)
and the whole service (``llmserve serve --torch-threads T``; ``default``: no option, the server's own
choice) run the same prompts (token ids cut from the corpus, greedy, ``ignore_eos``), alternating
offline, served, served, offline ... so that a busy machine weighs on both alike. Each request's
figure is output tokens over the wall time of the request (prefill included, as llama-bench's tg
is not: the prompts are short, 32 tokens); at concurrency C the figure is all output tokens over the
wall time of C requests at once. Served over HTTP is the OpenAI ``/v1/completions`` SSE stream
(a raw-socket client, ``load_clients``), over gRPC the ``GenerateStream`` RPC.

With ``--transports ...,llama-server`` llama.cpp's server (``make bench-peer``; ``-np 16``, the same
threads) serves the same GGUF file to the same HTTP client, and the row gives ours over it.

It also reports, per streamed token at concurrency 1, where a served token's time goes, by
difference: the engine's step (the offline figure), engine -> gateway -> client over gRPC (a second
server, ``--skip-tokenizer-init``, streams token ids alone: transport ``grpc-ids``), the
detokenizing hop (gRPC with text against ids alone) and HTTP/SSE against gRPC.
Target (issue 37): served batch-1 >= 0.9x offline at the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.load_clients import grpc_requests, openai_load
from benchmarks.loadgen import run_load
from benchmarks.quantized import prompt_ids
from engine_svc.models.model_path import resolve_model_path
from engine_svc.server.cpus import torch_threads
from tokenizer_svc.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent


class Offline:
    def __init__(self, model: Path, threads: int) -> None:
        from engine_svc.llm import LLM

        self.threads = threads
        torch.set_num_threads(threads)
        self.llm = LLM(model=str(model), max_num_seqs=256)

    def run(self, prompts: list[list[int]], tokens: int, concurrency: int) -> float:
        """Output tokens per second: requests in groups of ``concurrency`` at once."""
        from engine_svc.sampling_params import SamplingParams

        torch.set_num_threads(self.threads)
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), concurrency):
            group = prompts[i : i + concurrency]
            for r in self.llm.generate(group, sp, use_tqdm=False):
                n += len(r.outputs[0].token_ids)
        return n / (time.perf_counter() - start)

    def close(self) -> None:
        self.llm.shutdown()


def streamed_rate(group_load, prompts, concurrency: int) -> float:
    """Output tokens per second of wall time: ``group_load(group)`` runs each group of
    ``concurrency`` prompts at once and returns its (records, wall seconds)."""
    n, total_wall = 0, 0.0
    for i in range(0, len(prompts), concurrency):
        recs, wall = group_load(prompts[i : i + concurrency])
        errors = [r.error for r in recs if r.error]
        if errors:
            raise RuntimeError(f"requests failed: {errors[:3]}")
        n += sum(len(r.token_times) for r in recs)
        total_wall += wall
    return n / total_wall


def http_rate(port: int, prompts, tokens: int, concurrency: int) -> float:
    """``streamed_rate`` over the OpenAI ``/v1/completions`` SSE stream at ``port``."""

    def group_load(group):
        return asyncio.run(openai_load("127.0.0.1", port, "", group, [tokens] * len(group), len(group)))

    return streamed_rate(group_load, prompts, concurrency)


class Served:
    def __init__(self, model: Path, threads: str, token_only: bool = False) -> None:
        from tests.service_process import ServiceProcess

        args = ["--http-port", "0"] + ([] if threads == "default" else ["--torch-threads", threads])
        if token_only:  # the gateway detokenizes nothing: token ids from the engine straight out
            args.append("--skip-tokenizer-init")
        self.sp = ServiceProcess(model, *args).start()

    def run(self, prompts, tokens: int, concurrency: int, transport: str) -> float:
        if transport == "http":
            return http_rate(self.sp.http_port, prompts, tokens, concurrency)

        def group_load(group):
            return asyncio.run(run_load(self.sp.target, grpc_requests(group, tokens), len(group)))

        return streamed_rate(group_load, prompts, concurrency)

    def close(self) -> None:
        self.sp.kill()


LLAMA_SERVER = ROOT / "benchmarks" / ".llamacpp" / "bin" / "llama-server"


class LlamaServer:
    """llama.cpp's ``llama-server`` on the same GGUF file, threads and client (``make bench-peer``
    builds it): ``-np 16`` slots, a context for 16 of these requests, measured as the ``llama-server``
    transport over the same raw-socket OpenAI client as ours."""

    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int) -> None:
        import socket
        import subprocess
        import urllib.request

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.http_port = sock.getsockname()[1]
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "16", "-c", str(ctx)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.http_port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:  # until /health answers 200 (the model is loaded), or the server died
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("llama-server did not become healthy in 300 s")
            time.sleep(0.5)

    def run(self, prompts, tokens: int, concurrency: int, transport: str) -> float:
        return http_rate(self.http_port, prompts, tokens, concurrency)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def hops(row: dict, transports: list[str]) -> dict[str, float]:
    """Where a streamed token's time goes at batch 1, by difference of the per-token times: the
    engine's step (offline), engine -> gateway -> gRPC client (token ids only), detokenizing (the
    tokenizer worker's hop), and HTTP/SSE against gRPC."""
    ms = {k: 1000.0 / row[k] for k in ("offline", *transports)}
    out = {"engine step": ms["offline"]}
    if "grpc-ids" in ms:
        out["engine->gateway->grpc"] = ms["grpc-ids"] - ms["offline"]
        if "grpc" in ms:
            out["detokenize"] = ms["grpc"] - ms["grpc-ids"]
    if "grpc" in ms and "http" in ms:
        out["http over grpc"] = ms["http"] - ms["grpc"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--threads", default="default,2", help="comma list: 'default' or a number")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0, help="per concurrency (0: max(2, concurrency))")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--transports",
        default="http,grpc,grpc-ids",
        help="http (OpenAI SSE), grpc (GenerateStream with text), grpc-ids (a --skip-tokenizer-init server), "
        "llama-server (llama.cpp's, same file, threads and HTTP client; a GGUF model only)",
    )
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER), help="the llama-server binary")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model = Path(args.model)
    where = resolve_model_path(model)
    tok = load_tokenizer(where.gguf if where.is_gguf else where.root)
    concs = [int(c) for c in args.concurrency.split(",")]
    transports = args.transports.split(",")
    results: dict = {"model": str(model), "tokens": args.tokens, "rows": []}
    for threads in args.threads.split(","):
        t = torch_threads(None) if threads == "default" else int(threads)
        off = Offline(model, t)
        srv = Served(model, threads) if {"http", "grpc"} & set(transports) else None
        ids = Served(model, threads, token_only=True) if "grpc-ids" in transports else None
        peer = None
        if "llama-server" in transports:
            if not where.is_gguf:
                raise SystemExit("--transports llama-server: llama.cpp serves a GGUF file, this model is not")
            ctx = 16 * (args.prompt_len + args.tokens + 64)
            peer = LlamaServer(Path(args.llama_server), where.gguf, t, ctx)
        servers = {"http": srv, "grpc": srv, "grpc-ids": ids, "llama-server": peer}
        try:
            for c in concs:
                n = args.requests or max(2, c)
                prompts = prompt_ids(tok, n, args.prompt_len)
                off.run(prompts[:c], 8, c)  # warm both
                for tr in transports:
                    servers[tr].run(prompts[:c], 8, c, tr)
                figs: dict[str, list[float]] = {"offline": [], **{tr: [] for tr in transports}}
                for r in range(args.rounds):
                    order = transports if r % 2 == 0 else list(reversed(transports))
                    figs["offline"].append(off.run(prompts, args.tokens, c))
                    for tr in order:
                        figs[tr].append(servers[tr].run(prompts, args.tokens, c, tr))
                row = {"threads": threads, "torch_threads": t, "concurrency": c}
                for k, v in figs.items():
                    row[k] = statistics.mean(v)
                    row[k + "_rounds"] = v
                for tr in transports:
                    row[f"{tr}_over_offline"] = [
                        s / o for s, o in zip(figs[tr], figs["offline"], strict=True)
                    ]
                results["rows"].append(row)
                ratios = "  ".join(
                    f"{tr} {row[tr]:.1f} ({', '.join(f'{x:.2f}' for x in row[tr + '_over_offline'])}x)"
                    for tr in transports
                )
                if "llama-server" in row and "http" in row:
                    row["http_over_llama_server"] = row["http"] / row["llama-server"]
                    ratios += f"  ours/llama-server over HTTP {row['http_over_llama_server']:.2f}x"
                print(
                    f"threads {threads} ({t}), {c} at once: offline {row['offline']:.1f} tok/s  {ratios}",
                    flush=True,
                )
                if c == 1:
                    row["hops_ms"] = hops(row, transports)
                    print(
                        "  per token: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["hops_ms"].items()),
                        flush=True,
                    )
        finally:
            for server in {id(s): s for s in servers.values() if s}.values():
                server.close()
            off.close()
    if args.out:
        write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
