"""Editor autocomplete: a keystroke session of fill-in-the-middle requests, ours against llama-server.

    python -m benchmarks.autocomplete [--model models/qwen2.5-coder-0.5b] [--threads 2] [--keystrokes 20]
    python -m benchmarks.autocomplete --speculation   # ours with n-gram drafts against ours without
    python -m benchmarks.autocomplete --ours-ngram    # ours with n-gram drafts against llama-server
    python -m benchmarks.autocomplete --fim-order spm --llama-spm   # suffix first on both sides
    python -m benchmarks.autocomplete --module calendar --context string,shlex   # another file typed into
    # a session too long for one quiet slot (the 1.5B's llama-server side), in ranges, then merged:
    python -m benchmarks.autocomplete --model models/qwen2.5-coder-1.5b --skip-ours \
        --keystroke-range 1-10 --results-name a     # then --keystroke-range 10-20 --results-name b
    python -m benchmarks.autocomplete --merge benchmarks/results/{ours,a,b}.json

The session: a real source file nobody here wrote (a module of Python's standard library), the
cursor at the start of one of its lines with about 1.5k tokens before it, two more standard-library
modules as other files of the project (``input_extra``). The "user" types that line's real text one
character a keystroke; each keystroke is one ``POST /infill`` (greedy, ``n_predict`` 32), sent when
the previous answer is in, to our server and to llama.cpp's ``llama-server`` (same GGUF file, same
threads, one slot). Per server: the cold request, p50 and p95 over the keystrokes after it, the
prompt tokens computed per keystroke (ours: ``tokens_evaluated - tokens_cached``; llama.cpp:
``timings.prompt_n``), and how many completions continue the real text. Ratios are of this one run.
With both sides, both servers are up together and each keystroke goes to one then the other
(alternating which goes first), so that a change in the machine's speed during the run (a shared
host's other tenants) falls on both sides alike; ``--sequential`` runs one whole session, then the
other (the results files before 2026-12-06 were made so).
The layout: ours sends ``fim_order`` (``--fim-order``, default psm, the server's default and llama-server's:
prefix, suffix, middle; ``spm`` puts the suffix first, so a keystroke recomputes only the changed tail,
but Qwen2.5-Coder does not complete from it); llama-server runs its default, or with ``--spm-infill``
(``--llama-spm``). benchmarks/fim_order.py compares how well each completes.

``--ours-ngram``: our server with n-gram prompt lookup (``--speculative-config``, ``--ngram-k``
drafts a step, default 4; the governor deciding), against llama-server as it runs by default.

``--speculation``: instead of llama-server, our server with n-gram prompt lookup
(``--speculative-config``, the governor deciding) on one side and ``speculative: false`` on the
other, each keystroke sent by both sides in turn (alternating who goes first), as two tenants so
that each side has its own prefix cache; per side the drafted and accepted tokens
(``timings.draft_n``, ``draft_n_accepted``).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.common import RESULTS_DIR, percentile, write_result

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "benchmarks" / ".llamacpp" / "bin" / "llama-server"
MODEL = ROOT / "models" / "qwen2.5-coder-0.5b"


def stdlib_source(module: str) -> tuple[str, str]:
    path = Path(importlib.util.find_spec(module).origin)
    return f"Lib/{path.name}", path.read_text()


def session(
    keystrokes: int, prefix_chars: int, module: str = "textwrap", context=("string", "shlex")
) -> dict:
    """The file, the line typed and the context files (the same for both servers): the cursor at the
    first line after ``prefix_chars`` of ``module``'s source that is long enough to type
    ``keystrokes`` characters of."""
    name, text = stdlib_source(module)
    lines = text.splitlines(keepends=True)
    at, pos = 0, 0
    for i, line in enumerate(lines):  # the first long line after prefix_chars of text
        if pos >= prefix_chars and len(line.strip()) > keystrokes + 8:
            at = i
            break
        pos += len(line)
    line = lines[at]
    indent = len(line) - len(line.lstrip())
    before = "".join(lines[:at]) + line[:indent]
    typed = line[indent:]
    after = "".join(lines[at + 1 :])[:2000]
    extra = [stdlib_source(m) for m in context if m != module]
    return {"file": name, "before": before, "typed": typed, "after": after, "extra": extra}


def keystroke_bodies(s: dict, keystrokes: int, n_predict: int) -> list[dict]:
    extra = [{"filename": f, "text": t} for f, t in s["extra"]]
    out = []
    for k in range(1, keystrokes + 1):
        out.append(
            {
                "input_prefix": s["before"] + s["typed"][:k],
                "input_suffix": "\n" + s["after"],
                "input_extra": extra,
                "n_predict": n_predict,
                "temperature": 0,
                "top_k": 1,
                "cache_prompt": True,
                "samplers": ["top_k"],
            }
        )
    return out


def continues(completion: str, rest: str) -> bool:
    n = min(len(completion), len(rest), 10)
    return n > 0 and completion[:n] == rest[:n]


class Session:
    """One server's keystroke session, a keystroke at a time (so that two can alternate)."""

    def __init__(self, url: str, s: dict, ours: bool, key: str | None = None) -> None:
        self.url, self.s, self.ours = url, s, ours
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(timeout=1800, headers=headers)
        self.latencies: list[float] = []
        self.computed: list[int] = []
        self.hits = self.drafted = self.accepted = 0
        self.contents: list[str] = []

    def keystroke(self, k: int, body: dict) -> None:
        t0 = time.perf_counter()
        r = self.client.post(self.url + "/infill", json=body)
        self.latencies.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"keystroke {k}: {self.url} answered {r.status_code}: {r.text[:500]}")
        out = r.json()
        if self.ours:
            self.computed.append(out["tokens_evaluated"] - out["tokens_cached"])
        else:
            self.computed.append(out["timings"]["prompt_n"])
        self.drafted += out["timings"].get("draft_n", 0)
        self.accepted += out["timings"].get("draft_n_accepted", 0)
        rest = self.s["typed"][k:] + "\n" + self.s["after"]
        self.hits += continues(out["content"], rest)
        self.contents.append(out["content"])

    def result(self) -> dict:
        self.client.close()
        return summary(self.latencies, self.computed, self.hits) | {
            "draft_tokens": self.drafted,
            "accepted_draft_tokens": self.accepted,
            "completions": self.contents,
        }


def run_session(url: str, bodies: list[dict], s: dict, ours: bool, first: int = 1) -> dict:
    session_ = Session(url, s, ours)
    for k, body in enumerate(bodies, start=first):
        session_.keystroke(k, body)
    return session_.result() | {"first_keystroke": first}


def merge(paths: list[Path], s: dict) -> dict:
    """One session from runs of consecutive keystroke ranges (``--keystroke-range``, each range
    starting at the last one's end: its first request, the run's cold one, repeats a keystroke of the
    run before and is left out). Per side: the first run's cold request, the warm keystrokes of all."""
    import json

    docs = sorted((json.loads(Path(p).read_text()) for p in paths), key=lambda d: d["keystroke_range"][0])
    result = {
        k: v for k, v in docs[0].items() if k not in ("ours", "llama_server", "ratios", "same_completions")
    }
    result["merged_from"] = [str(p) for p in paths]
    for side in ("ours", "llama_server"):
        parts = [d[side] for d in docs if side in d]
        if not parts:
            continue
        for a, b in itertools.pairwise(parts):
            if b["first_keystroke"] != a["first_keystroke"] + a["keystrokes"] - 1:
                raise SystemExit(f"{side}: the ranges do not join at keystroke {b['first_keystroke']}")
        lat = parts[0]["latencies_s"] + [x for p in parts[1:] for x in p["latencies_s"][1:]]
        comp = parts[0]["computed_per_keystroke"] + [
            x for p in parts[1:] for x in p["computed_per_keystroke"][1:]
        ]
        contents = parts[0]["completions"] + [x for p in parts[1:] for x in p["completions"][1:]]
        first = parts[0]["first_keystroke"]
        hits = sum(
            continues(c, s["typed"][k:] + "\n" + s["after"]) for k, c in enumerate(contents, start=first)
        )
        result[side] = summary(lat, comp, hits) | {"completions": contents, "first_keystroke": first}
    return result


def summary(latencies: list[float], computed: list[int], hits: int) -> dict:
    warm = latencies[1:]
    return {
        "cold_s": latencies[0],
        "p50_s": percentile(warm, 50),
        "p95_s": percentile(warm, 95),
        "computed_cold": computed[0],
        "computed_per_keystroke_mean": statistics.mean(computed[1:]),
        "computed_per_keystroke": computed,
        "latencies_s": latencies,
        "continues_real_text": hits,
        "keystrokes": len(latencies),
    }


def ngram_config(k: int) -> str:
    """n-gram prompt lookup with ``k`` drafts a step (the governor deciding whether to draft)."""
    import json

    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return json.dumps(config)


class Ours:
    def __init__(self, gguf: Path, threads: int, ctx: int, extra: tuple[str, ...] = ()) -> None:
        from tests.service_process import ServiceProcess

        args = ["--http-port", "0", "--torch-threads", str(threads), "--max-model-len", str(ctx), *extra]
        # Under chrt (the quiet runs) a long prefill step can hold both cores past the gateway's
        # 5 s heartbeat rule: a silent engine is not a lost one here.
        args += ["--engine-heartbeat-timeout", "600"]
        self.sp = ServiceProcess(gguf, *args, startup_timeout_s=900).start()
        self.url = self.sp.http_url

    def close(self) -> None:
        self.sp.kill()


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int, spm: bool = False) -> None:
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", str(ctx)]
        cmd += ["--host", "127.0.0.1", "--port", str(port)] + (["--spm-infill"] if spm else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("llama-server did not become healthy in 300 s")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL, help="a GGUF file or a folder with one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keystrokes", type=int, default=20)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--prefix-chars", type=int, default=6000, help="about 1.5k tokens before the cursor")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--module", default="textwrap", help="the standard-library module typed into")
    ap.add_argument(
        "--context",
        default="string,shlex",
        help="standard-library modules sent as input_extra (comma-separated)",
    )
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--skip-ours", action="store_true", help="llama-server alone (a run split in two)")
    ap.add_argument("--sequential", action="store_true", help="one side's whole session, then the other's")
    ap.add_argument("--fim-order", choices=["psm", "spm"], default="psm", help="ours: the FIM layout")
    ap.add_argument("--llama-spm", action="store_true", help="llama-server with --spm-infill")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--speculation", action="store_true", help="ours with n-gram drafts against ours without")
    ap.add_argument(
        "--ours-ngram",
        action="store_true",
        help="against llama-server: ours with n-gram drafts (--speculative-config, the governor deciding)",
    )
    ap.add_argument("--ngram-k", type=int, default=4, help="drafts a step with n-gram speculation")
    ap.add_argument("--orders", action="store_true", help="ours in SPM against ours in PSM (one server)")
    ap.add_argument(
        "--keystroke-range",
        help="A-B: only keystrokes A to B of the session, A the run's cold request (a session split "
        "over runs that each fit a quiet slot; the next range starts at B)",
    )
    ap.add_argument("--results-name", default="autocomplete")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="ours: what the KV cache holds (auto: fp32; bfloat16: llama-server's default is an f16 cache)",
    )
    ap.add_argument(
        "--attention-dtype",
        default="auto",
        help="ours: attention's products (bfloat16: rounded queries and weights on a bf16 cache)",
    )
    ap.add_argument("--merge", nargs="+", type=Path, help="result files of a split session: one result")
    args = ap.parse_args()
    s = session(args.keystrokes, args.prefix_chars, args.module, tuple(args.context.split(",")))
    if args.merge:
        result = merge(args.merge, s)
        report(result)
        print(write_result(args.results_name, result, args.results_dir))
        return
    gguf = args.model if args.model.is_file() else next(args.model.glob("*.gguf"))
    bodies = keystroke_bodies(s, args.keystrokes, args.n_predict)
    first, last = 1, args.keystrokes
    if args.keystroke_range:
        first, last = (int(x) for x in args.keystroke_range.split("-"))
        if not 1 <= first < last <= args.keystrokes:
            ap.error(f"--keystroke-range: want 1 <= A < B <= {args.keystrokes}")
    bodies = bodies[first - 1 : last]
    ours_bodies = [{**b, "fim_order": args.fim_order} for b in bodies]
    result: dict = {
        "model": gguf.name,
        "threads": args.threads,
        "file": s["file"],
        "context_files": [f for f, _ in s["extra"]],
        "line": s["typed"].strip(),
        "n_predict": args.n_predict,
        "fim_order": {"ours": args.fim_order, "llama_server": "spm" if args.llama_spm else "psm"},
        "keystroke_range": [first, last],
        "kv_cache_dtype": {"ours": args.kv_cache_dtype, "llama_server": "f16 (its default)"},
        "attention_dtype": {"ours": args.attention_dtype},
    }
    if args.speculation:
        speculation(gguf, args, s, ours_bodies, result)
        return
    if args.orders:
        orders(gguf, args, s, bodies, result)
        return
    kv = ("--kv-cache-dtype", args.kv_cache_dtype, "--attention-dtype", args.attention_dtype)
    if args.ours_ngram:
        kv += ("--speculative-config", ngram_config(args.ngram_k))
    result["speculative_config"] = {"ours": ngram_config(args.ngram_k) if args.ours_ngram else None}
    sides = [] if args.skip_ours else [("ours", lambda: Ours(gguf, args.threads, args.ctx, kv))]
    if not args.skip_llama_server:
        sides.append(
            (
                "llama_server",
                lambda: LlamaServer(args.llama_server, gguf, args.threads, args.ctx, spm=args.llama_spm),
            )
        )
    if len(sides) == 2 and not args.sequential:
        alternate(sides, ours_bodies, bodies, s, first, result)
    else:
        for name, start in sides:
            server = start()
            try:
                ours = name == "ours"
                mine = ours_bodies if ours else bodies
                result[name] = run_session(server.url, mine, s, ours=ours, first=first)
            finally:
                server.close()
    result["alternated"] = len(sides) == 2 and not args.sequential
    report(result)
    print(write_result(args.results_name, result, args.results_dir))


def alternate(sides, ours_bodies: list[dict], bodies: list[dict], s: dict, first: int, result: dict) -> None:
    """Both servers up; keystroke k to each in turn, the side going first alternating with k."""
    servers: dict = {}
    try:
        for name, start in sides:
            servers[name] = start()
        sessions = {name: Session(server.url, s, ours=name == "ours") for name, server in servers.items()}
        for k, i in enumerate(range(len(bodies)), start=first):
            order = list(sessions.items()) if k % 2 else list(sessions.items())[::-1]
            for name, session_ in order:
                session_.keystroke(k, ours_bodies[i] if name == "ours" else bodies[i])
        for name, session_ in sessions.items():
            result[name] = session_.result() | {"first_keystroke": first}
    finally:
        for server in servers.values():
            server.close()


def report(result: dict) -> None:
    for name in ("ours", "llama_server"):
        if name not in result:
            continue
        r = result[name]
        print(
            f"{name}: cold {r['cold_s']:.2f}s ({r['computed_cold']} tokens), p50 {r['p50_s']:.2f}s, "
            f"p95 {r['p95_s']:.2f}s, {r['computed_per_keystroke_mean']:.0f} tokens computed a keystroke, "
            f"{r['continues_real_text']}/{r['keystrokes']} continue the real text"
        )
    if "llama_server" in result and "ours" in result:
        o, p = result["ours"], result["llama_server"]
        result["ratios"] = {
            "p50": o["p50_s"] / p["p50_s"],
            "p95": o["p95_s"] / p["p95_s"],
            "cold": o["cold_s"] / p["cold_s"],
            "computed_per_keystroke": o["computed_per_keystroke_mean"] / p["computed_per_keystroke_mean"],
        }
        print("ours / llama-server: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
        result["same_completions"] = sum(
            a == b for a, b in zip(o["completions"], p["completions"], strict=True)
        )


def speculation(gguf: Path, args, s: dict, bodies: list[dict], result: dict) -> None:
    """One server with n-gram drafts; per keystroke, alternating, the same request as two tenants
    (their own prefix caches), one with ``speculative: false``."""
    import tempfile

    keys = {"ngram": "ngram-side-key-0123456789", "plain": "plain-side-key-0123456789"}
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as f:
        f.write("".join(f"{name} {key}\n" for name, key in keys.items()))
    extra = ("--speculative-config", ngram_config(args.ngram_k), "--api-key-file", f.name)
    extra += ("--kv-cache-dtype", args.kv_cache_dtype, "--attention-dtype", args.attention_dtype)
    server = Ours(gguf, args.threads, args.ctx, extra)
    try:
        sessions = {name: Session(server.url, s, ours=True, key=key) for name, key in keys.items()}
        for k, body in enumerate(bodies, start=1):
            order = list(sessions.items()) if k % 2 else list(sessions.items())[::-1]
            for name, session_ in order:
                session_.keystroke(k, body if name == "ngram" else {**body, "speculative": False})
        same = sessions["plain"].contents == sessions["ngram"].contents
        for name, session_ in sessions.items():
            r = result[name] = session_.result()
            rate = r["accepted_draft_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
            print(
                f"{name}: cold {r['cold_s']:.2f}s, p50 {r['p50_s']:.2f}s, p95 {r['p95_s']:.2f}s, "
                f"{r['draft_tokens']} drafted, {r['accepted_draft_tokens']} accepted ({rate:.0%}), "
                f"{r['continues_real_text']}/{r['keystrokes']} continue the real text"
            )
    finally:
        server.close()
    o, p = result["ngram"], result["plain"]
    result["same_completions"] = same  # greedy: speculation changes the speed only
    result["ratios"] = {"p50": o["p50_s"] / p["p50_s"], "p95": o["p95_s"] / p["p95_s"]}
    print(
        f"same completions: {same}; ngram / plain: p50 {result['ratios']['p50']:.2f}x, "
        f"p95 {result['ratios']['p95']:.2f}x"
    )
    name = "autocomplete-speculation" if args.results_name == "autocomplete" else args.results_name
    print(write_result(name, result, args.results_dir))


def orders(gguf: Path, args, s: dict, bodies: list[dict], result: dict) -> None:
    """One server; per keystroke, alternating who goes first, the request in SPM and in PSM (the
    repository's files, before both layouts' code, are computed once and shared)."""
    server = Ours(gguf, args.threads, args.ctx)
    try:
        sessions = {order: Session(server.url, s, ours=True) for order in ("spm", "psm")}
        for k, body in enumerate(bodies, start=1):
            order = list(sessions.items()) if k % 2 else list(sessions.items())[::-1]
            for name, session_ in order:
                session_.keystroke(k, {**body, "fim_order": name})
        for name, session_ in sessions.items():
            r = result[name] = session_.result()
            print(
                f"{name}: cold {r['cold_s']:.2f}s ({r['computed_cold']} tokens), p50 {r['p50_s']:.2f}s, "
                f"p95 {r['p95_s']:.2f}s, {r['computed_per_keystroke_mean']:.0f} tokens computed a keystroke, "
                f"{r['continues_real_text']}/{r['keystrokes']} continue the real text"
            )
    finally:
        server.close()
    o, p = result["spm"], result["psm"]
    result["ratios"] = {"p50": o["p50_s"] / p["p50_s"], "p95": o["p95_s"] / p["p95_s"]}
    print(f"spm / psm: p50 {result['ratios']['p50']:.2f}x, p95 {result['ratios']['p95']:.2f}x")
    print(write_result("autocomplete-orders", result, args.results_dir))


if __name__ == "__main__":
    main()
