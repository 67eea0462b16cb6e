"""llmserve side by side with vLLM's CPU build: same model, same token ids, same dtype, one run.

Offline (each system's ``LLM.generate``, a warm-up first, prefix caching on as both default):
  1. 64 requests, prompts 32-512, outputs 16-256 (output tok/s)
  2. 128 requests, prompts 8-128, long-tailed outputs (output tok/s)
  3. 64 requests sharing a 1024-token prefix + 64 own tokens, 32 out each (seconds)
each at both systems' defaults (llmserve: torch's default threads, every core; vLLM: one engine
thread bound to one core, the other core left to its front end) and at matched threads (llmserve at
vLLM's engine thread count). Serving at concurrency 1 and 16: vLLM's OpenAI server
(``/v1/completions``, prompt token ids, streamed) against our gateway's gRPC ``GenerateStream`` and
against our gateway's own OpenAI endpoint (the same client, the same requests: like for like), each
with its own default threads (on two cores both engines run one torch thread: defaults are matched).

Targets (ratios, ours over vLLM): offline >= 1.3x at defaults and >= 1.0x matched; serving >= 1.2x
output tok/s with TTFT p99 and ITL p99 no worse (ours / vLLM <= 1). The peer lives in its own venv
(``make bench-peer``); without it every peer figure is reported as missing, never as met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.load_clients import grpc_requests, mean_summary, openai_load
from benchmarks.vllm_peer import find_vllm_python, run_vllm_workloads, server_command, tree_cpu_s, vllm_env

# Prompt ids stay below the default tokenizer's vocabulary, so that our gateway can detokenize.
ID_RANGE = (3, 8000)
FULL = dict(
    offline=dict(
        random=dict(num_requests=64, prompt_range=(32, 512), output_range=(16, 256)),
        long_tail=dict(num_requests=128, prompt_range=(8, 128), output_median=32, output_max=512),
        shared_prefix=dict(num_requests=64, prefix_len=1024, own_len=64, output_len=32),
    ),
    serving=dict(levels={1: 16, 16: 48}, prompt_range=(32, 512), output_range=(16, 256)),
    matched_threads=1,
)
QUICK = dict(
    offline=dict(
        random=dict(num_requests=6, prompt_range=(8, 48), output_range=(4, 12)),
        long_tail=dict(num_requests=8, prompt_range=(4, 24), output_median=4, output_max=24),
        shared_prefix=dict(num_requests=6, prefix_len=64, own_len=8, output_len=4),
    ),
    serving=dict(levels={1: 2, 2: 4}, prompt_range=(8, 24), output_range=(4, 8)),
    matched_threads=1,
)
# Which offline figure is a rate (higher is better) and which a duration.
OFFLINE_METRIC = dict(random="output_tok_s", long_tail="output_tok_s", shared_prefix="wall_s")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --- workloads --------------------------------------------------------------------------------
def ids(rng: random.Random, n: int, top: int = ID_RANGE[1]) -> list[int]:
    return [rng.randrange(ID_RANGE[0], top) for _ in range(n)]


def offline_workloads(w: dict, top: int, seed: int = 1234) -> dict[str, dict]:
    rng = random.Random(seed)
    out = {}
    r = w["random"]
    lens = [
        (rng.randint(*r["prompt_range"]), rng.randint(*r["output_range"])) for _ in range(r["num_requests"])
    ]
    out["random"] = dict(prompts=[ids(rng, p, top) for p, _ in lens], output_lens=[o for _, o in lens])
    t = w["long_tail"]
    # Long-tailed outputs: log-normal around the median (sigma 1), clipped to [1, max].
    outs = [
        max(1, min(t["output_max"], int(rng.lognormvariate(math.log(t["output_median"]), 1.0))))
        for _ in range(t["num_requests"])
    ]
    out["long_tail"] = dict(
        prompts=[ids(rng, rng.randint(*t["prompt_range"]), top) for _ in outs], output_lens=outs
    )
    s = w["shared_prefix"]
    prefix = ids(rng, s["prefix_len"], top)
    out["shared_prefix"] = dict(
        prompts=[prefix + ids(rng, s["own_len"], top) for _ in range(s["num_requests"])],
        output_lens=[s["output_len"]] * s["num_requests"],
    )
    return out


def serving_workload(w: dict, concurrency: int, num: int) -> tuple[list[list[int]], list[int]]:
    rng, top = random.Random(100 + concurrency), w["id_top"]
    lens = [(rng.randint(*w["prompt_range"]), rng.randint(*w["output_range"])) for _ in range(num)]
    return [ids(rng, p, top) for p, _ in lens], [o for _, o in lens]


def peer_model_dir(quick: bool) -> Path:
    """The benchmark checkpoint (the same weights for both systems) plus the default model's tokenizer
    files, which our gateway needs to detokenize; vLLM starts with ``skip_tokenizer_init``."""
    src = common.model_dir(quick)
    out = common.CACHE_DIR / f"peer-{src.name}"
    if not (out / ".complete").exists():
        tok = Path("models/default")
        if not (tok / "tokenizer.json").exists():
            from engine_svc.models.build_default import build_default_model

            tok = build_default_model(Path(tempfile.mkdtemp(prefix="llmserve-peer-")) / "default")
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("."):
                (out / f.name).unlink(missing_ok=True)
                (out / f.name).symlink_to(f)
        for f in TOKENIZER_FILES:
            shutil.copy(tok / f, out / f)
        (out / ".complete").write_text("")
    return out


# --- our offline side, in a child process (its own torch threads) ------------------------------
def ours_child(spec_path: str, out_path: str, threads: int) -> int:
    import torch

    from engine_svc import LLM, SamplingParams

    if threads > 0:
        torch.set_num_threads(threads)
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    # The random benchmark model runs in fp32 on both sides; a real checkpoint at whatever the spec
    # names ("auto": the engine's default for it).
    dtype = spec.get("dtype", "float32")
    extra = {"linear_dtype": spec["linear_dtype"]} if spec.get("linear_dtype") else {}
    llm = LLM(spec["model"], dtype=None if dtype == "auto" else dtype, device="cpu", seed=0, **extra)
    startup = time.perf_counter() - t0

    def run(prompts, output_lens) -> dict:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        cpu0, t = tree_cpu_s(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t, tree_cpu_s() - cpu0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return dict(wall_s=wall, cpu_s=cpu, output_tokens=tokens, output_tok_s=tokens / wall)

    run([[5 + i for i in range(40)], [7 + i for i in range(24)]], [8, 8])  # warm-up, as vLLM's
    result = {name: run(w["prompts"], w["output_lens"]) for name, w in spec["workloads"].items()}
    result["_meta"] = dict(torch_threads=torch.get_num_threads(), startup_s=startup)
    Path(out_path).write_text(json.dumps(result))
    return 0


def run_ours(
    model: Path,
    workloads: dict,
    threads: int,
    work_dir: Path,
    dtype: str = "float32",
    tag: str = "",
    linear_dtype: str | None = None,
) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    spec, out = work_dir / "ours_workload.json", work_dir / f"ours_result{tag}_{threads}.json"
    out.unlink(missing_ok=True)
    spec.write_text(
        json.dumps(dict(model=str(model), workloads=workloads, dtype=dtype, linear_dtype=linear_dtype))
    )
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "benchmarks.peer", "--ours-child", str(spec), str(out), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"llmserve offline run failed: {proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# --- serving: an OpenAI streaming client (no HTTP library in the project's venv) --------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http_ok(port: int, path: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                if b" 200 " in s.recv(64):
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM's server did not answer {path} within {timeout_s:.0f} s")


def serve_vllm(python: str, model: Path, w: dict, work_dir: Path) -> dict:
    from benchmarks.loadgen import summarize

    port = free_port()
    log = open(work_dir / "vllm_server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        server_command(python, model, port), stdout=log, stderr=subprocess.STDOUT, env=vllm_env()
    )
    try:
        wait_http_ok(port, "/health", proc, timeout_s=600)
        out = {}
        for c, num in w["levels"].items():
            prompts, outs = serving_workload(w, c, num)
            # Warm-up with every prompt (each prompt shape once), 4 tokens each: as ours.
            asyncio.run(openai_load("127.0.0.1", port, str(model), prompts, [4] * len(prompts), c))
            cpu0 = tree_cpu_s(proc.pid)
            out[c] = summarize(*asyncio.run(openai_load("127.0.0.1", port, str(model), prompts, outs, c)))
            out[c]["server_cpu_s"] = tree_cpu_s(proc.pid) - cpu0
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def serve_ours(model: Path, w: dict) -> tuple[dict, dict]:
    """Our gateway at each level, through gRPC and through its OpenAI endpoint, alternated and
    repeated (gRPC, HTTP, HTTP, gRPC; each API's figures the mean of its two passes): the first
    pass after a warm-up ran up to 2x slower than the next on this machine, whichever API had it."""
    from benchmarks.loadgen import run_load, summarize
    from tests.service_process import ServiceProcess

    grpc_out, http_out = {}, {}
    with ServiceProcess(model, "--http-port", "0") as sp:
        for c, num in w["levels"].items():
            prompts, outs = serving_workload(w, c, num)
            warm = [grpc_requests([p], 4)[0] for p in prompts]  # every prompt shape once
            asyncio.run(run_load(sp.target, warm, c))
            asyncio.run(openai_load("127.0.0.1", sp.http_port, "", prompts[:c], [4] * c, c))
            reqs = [grpc_requests([p], n)[0] for p, n in zip(prompts, outs, strict=True)]
            passes: dict[str, list] = {"grpc": [], "http": []}
            for api in ("grpc", "http", "http", "grpc"):
                cpu0 = tree_cpu_s(sp.pid)
                if api == "grpc":
                    r = summarize(*asyncio.run(run_load(sp.target, reqs, c)))
                else:
                    r = summarize(*asyncio.run(openai_load("127.0.0.1", sp.http_port, "", prompts, outs, c)))
                r["server_cpu_s"] = tree_cpu_s(sp.pid) - cpu0
                passes[api].append(r)
            for api, out in (("grpc", grpc_out), ("http", http_out)):
                out[c] = mean_summary(passes[api]) | {"transport": sp.transport, "passes": passes[api]}
    return grpc_out, http_out


# --- figures and targets ----------------------------------------------------------------------
def missing(name: str, op: str, threshold: float, unit: str, why: str) -> dict:
    """A judged figure whose peer did not run: no value and no verdict, reported as missing."""
    return dict(
        name=name, value=None, op=op, target=float(threshold), unit=unit, met=None, note=f"MISSING: {why}"
    )


def offline_ratio(name: str, ours: dict, peer: dict) -> float:
    key = OFFLINE_METRIC[name]
    a, b = ours[name][key], peer[name][key]
    return a / b if key == "output_tok_s" else b / a


def median_runs(runs: list[dict]) -> dict:
    """Per workload, the run with the median figure (its whole record)."""
    if len(runs) == 1:
        return runs[0]
    out = {"_meta": runs[0]["_meta"]}
    for name, key in OFFLINE_METRIC.items():
        ranked = sorted((r[name] for r in runs), key=lambda m: m[key])
        out[name] = ranked[len(ranked) // 2] | dict(all=[m[key] for m in (r[name] for r in runs)])
    return out


def main(argv: list[str] | None = None) -> dict | int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ours-child"]:
        return ours_child(argv[1], argv[2], int(argv[3]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, our side only unless --with-peer")
    ap.add_argument(
        "--with-peer", action="store_true", help="in --quick, run vLLM too (needs head_dim >= 32)"
    )
    ap.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)  # run_all passes it
    ap.add_argument("--repeats", type=int, default=1, help="offline runs per system, in alternating order")
    ap.add_argument("--no-serving", action="store_true")
    ap.add_argument("--serving-only", action="store_true", help="skip the offline runs")
    ap.add_argument(
        "--short-serving", action="store_true", help="serving with fewer, shorter requests (a shared machine)"
    )
    ap.add_argument(
        "--reuse-offline", action="store_true", help="take the offline figures from the last run's files"
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    w = QUICK if args.quick else FULL
    # vLLM's CPU attention has no kernel for the quick model's head_dim (16): quick mode runs the full
    # model only with --with-peer.
    small = args.quick and not args.with_peer
    # Offline: the bare checkpoint (no tokenizer: neither side detokenizes). Serving: the same weights
    # with the tokenizer our gateway needs (vLLM's server skips its tokenizer).
    plain, model = common.model_dir(small), peer_model_dir(small)
    work = common.CACHE_DIR / "peer-run"
    top = min(ID_RANGE[1], common.vocab_size(small))
    workloads = offline_workloads(w["offline"], top)
    w = dict(w, serving=dict(w["serving"], id_top=top))
    if args.short_serving:
        w["serving"].update(levels={1: 6, 16: 32}, prompt_range=(32, 256), output_range=(16, 64))
    python, why = find_vllm_python()
    if args.quick and not args.with_peer:
        python, why = None, "not run in --quick (use --with-peer)"
    print(f"peer: {why}", flush=True)
    matched = w["matched_threads"]

    ours_default, ours_matched, peer_runs = [], [], []
    reused = {}
    if args.reuse_offline:
        # The offline results an earlier run of this benchmark left in its work folder (each side's
        # child writes its own file): for re-running the serving half alone. Their times are recorded.
        files = dict(peer=work / "vllm_result.json", default=work / "ours_result_0.json")
        files["matched"] = work / f"ours_result_{matched}.json"
        for who, f in files.items():
            if who == "peer" and not python:
                continue
            doc = json.loads(f.read_text())
            dict(peer=peer_runs, default=ours_default, matched=ours_matched)[who].append(doc)
            reused[who] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.stat().st_mtime))
        print(f"  offline results reused from {work}: {reused}", flush=True)
    for rep in range(0 if args.reuse_offline or args.serving_only else args.repeats):
        order = ["peer", "matched", "default"] if rep % 2 == 0 else ["default", "matched", "peer"]
        for who in order:
            if who == "peer":
                if not python:
                    continue
                peer_runs.append(run_vllm_workloads(python, plain, workloads, work))
            elif who == "default":
                ours_default.append(run_ours(plain, workloads, 0, work))
            elif who == "matched":
                ours_matched.append(run_ours(plain, workloads, matched, work))
            print(f"  offline run {rep + 1}: {who} done", flush=True)
    figures: dict = dict(
        peer_note=why,
        ours_default=median_runs(ours_default) if ours_default else None,
        ours_matched=median_runs(ours_matched) if ours_matched else None,
        workloads={
            k: dict(requests=len(v["prompts"]), output_tokens=sum(v["output_lens"]))
            for k, v in workloads.items()
        },
    )
    peer = median_runs(peer_runs) if peer_runs else None
    serving_peer = python
    if peer is not None:
        figures["vllm"] = peer
        if peer["_meta"].get("engine_torch_threads") not in (None, matched):
            print(f"  note: vLLM's engine ran {peer['_meta']['engine_torch_threads']} threads, not {matched}")
    targets: list[dict] = []
    labels = dict(
        random="64 requests, prompts 32-512, outputs 16-256 (output tok/s)",
        long_tail="128 requests, prompts 8-128, long-tailed outputs (output tok/s)",
        shared_prefix="64 requests sharing a 1024-token prefix, 32 out (speed: vLLM s / our s)",
    )
    for name in OFFLINE_METRIC:
        for side, label, goal in (
            ("ours_default", "defaults", 1.3),
            ("ours_matched", "matched threads", 1.0),
        ):
            title = f"offline {labels[name]}, llmserve / vLLM, {label}"
            if peer is None or figures[side] is None:
                note = why if peer is None else "offline not run"
                targets.append(missing(title, ">=", goal, "x", note))
                if side == "ours_matched":
                    targets.append(missing(f"{title}, per CPU-second", ">=", goal, "x", note))
            else:
                ratio = offline_ratio(name, figures[side], peer)
                figures.setdefault("ratios", {})[f"{name}_{side}"] = ratio
                # Output tokens per CPU-second of each side's whole process tree. At matched threads
                # this is judged too: vLLM's offline LLM runs its engine core in a process of its own
                # beside the front end (~1.1 cores for "one thread"), and on a shared machine two
                # processes get two shares of the CPU where ours, one process, gets one.
                ours_m, peer_m = figures[side][name], peer[name]
                per_cpu = (ours_m["output_tokens"] / ours_m["cpu_s"]) / (
                    peer_m["output_tokens"] / peer_m["cpu_s"]
                )
                figures.setdefault("ratios_per_cpu_s", {})[f"{name}_{side}"] = per_cpu
                targets.append(common.target(title, ratio, ">=", goal, "x"))
                if side == "ours_matched":
                    targets.append(common.target(f"{title}, per CPU-second", per_cpu, ">=", goal, "x"))
    if not args.no_serving:
        figures["serving_ours"], figures["serving_ours_http"] = serve_ours(model, w["serving"])
        if serving_peer:
            figures["serving_vllm"] = serve_vllm(python, model, w["serving"], work)
        for c in w["serving"]["levels"]:
            for api, label, tok_goal in (
                ("serving_ours", "llmserve gRPC", 1.2),
                ("serving_ours_http", "llmserve OpenAI", 1.2),
            ):
                ours = figures[api][c]
                checks = (
                    (f"serving c={c}: output tok/s, {label} / vLLM OpenAI", "output_tok_s", ">=", tok_goal),
                    (f"serving c={c}: TTFT p99, {label} / vLLM (lower is better)", "ttft_p99_ms", "<=", 1.0),
                    (f"serving c={c}: ITL p99, {label} / vLLM (lower is better)", "itl_p99_ms", "<=", 1.0),
                )
                for title, key, op, goal in checks:
                    if not serving_peer:
                        targets.append(missing(title, op, goal, "x", why))
                    else:
                        peer_c = figures["serving_vllm"][c]
                        targets.append(common.target(title, ours[key] / peer_c[key], op, goal, "x"))
                if serving_peer:  # informational: the p50s of the same comparison
                    peer_c = figures["serving_vllm"][c]
                    figures.setdefault("serving_ratios", {})[f"{api}_c{c}"] = {
                        k: ours[k] / peer_c[k]
                        for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
                    }
    print_table(figures, w)
    config = dict(
        workloads=w,
        model=model.name,
        dtype="float32",
        repeats=args.repeats,
        offline_reused_from_files_written=reused or None,
        cpus=os.cpu_count(),
        load_average=os.getloadavg(),
    )
    args.quick = bool(args.quick)
    doc = common.result_doc("peer", args.quick, config, figures, targets, None, time.perf_counter() - t_start)
    print(f"[peer] {doc['elapsed_s']:.1f} s")
    for t in targets:
        if t["value"] is None:
            print(f"  {t['name']}: {t['note']}")
    common.print_targets([t for t in targets if t["value"] is not None])
    print(f"  -> {common.write_result('peer', doc, args.results_dir)}")
    return doc


def print_table(f: dict, w: dict) -> None:
    peer = f.get("vllm")
    print(f"{'workload':>14} {'vLLM':>9} {'ours dflt':>9} {'ours 1T':>9}  (tok/s; shared_prefix: s)")
    for name, key in OFFLINE_METRIC.items() if f["ours_default"] else ():
        cells = [
            peer[name][key] if peer else float("nan"),
            f["ours_default"][name][key],
            f["ours_matched"][name][key],
        ]
        print(f"{name:>14} " + " ".join(f"{v:9.2f}" for v in cells))
    for c in w["serving"]["levels"] if "serving_ours" in f else []:
        for who in ("serving_vllm", "serving_ours", "serving_ours_http"):
            if who in f:
                r = f[who][c]
                print(
                    f"  c={c:<3} {who[8:]:>9}: {r['output_tok_s']:7.1f} tok/s  "
                    f"TTFT p50/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms  "
                    f"ITL p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms"
                    f"  errors {r['errors']}"
                )


if __name__ == "__main__":
    result = main()
    raise SystemExit(result if isinstance(result, int) else 0)
