"""llama.cpp's own ``llama-bench`` against our offline engine on the same GGUF file: prompt
processing of 512 tokens (pp512) and generation of 128 (tg128), two threads, tokens per second and
our ratio to llama.cpp.

    python -m benchmarks.llamacpp_bench --model models/qwen2.5-coder-0.5b [--rounds 3] [--threads 2]

llama.cpp is the peer that ``make bench-peer`` builds from source (llama.cpp b11434, into
``benchmarks/.llamacpp/bin``; ``--llama-bench PATH`` for another build). Each round runs
``llama-bench -p 512 -n 128 -r REPS --repack 0,1 -o json`` and keeps, for each test, the better of
repacking off and on (llama.cpp's own best on this CPU), then our engine on the same file, loaded
once, with the same workloads: pp512 is one request of 512 random token ids from an empty cache
generating one token (its prefill: 512 tokens over the request's wall time); tg128 is one request
of one token generating 128 with eos ignored (128 tokens over the wall time: one prefill step of a
single token and 127 decode steps, as llama-bench's tg128 decodes 128 single-token steps from an
empty context). Our model is served from the file's quantized blocks (the engine's default; a
file of a type it does not keep is dequantized). The systems alternate round by round: on a shared
machine only those ratios mean anything; the per-round ratios are printed with their median.

``--quick``: pp16 / tg8 and one repetition, to check the harness in seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BENCH = ROOT / "benchmarks" / ".llamacpp" / "bin" / "llama-bench"


def best_rates(records: list[dict], n_prompt: int, n_gen: int) -> dict:
    """From ``llama-bench -o json`` records: ``{"pp": tok/s, "tg": tok/s, "repack": {...}}``, the
    best ``avg_ts`` over the repack settings for the prompt test (n_prompt, 0) and the generation
    test (0, n_gen); a test missing from the records is an error naming it."""
    out: dict = {"repack": {}}
    for key, want in (("pp", (n_prompt, 0)), ("tg", (0, n_gen))):
        rows = [r for r in records if (int(r["n_prompt"]), int(r["n_gen"])) == want]
        if not rows:
            raise ValueError(f"llama-bench printed no {key}{max(want)} result (n_prompt, n_gen = {want})")
        best = max(rows, key=lambda r: float(r["avg_ts"]))
        out[key] = float(best["avg_ts"])
        out["repack"][key] = {str(bool(r.get("repack"))).lower(): float(r["avg_ts"]) for r in rows}
    return out


def run_llama_bench(binary: Path, model: Path, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing: `make bench-peer` builds it")
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(reps), "--repack", "0,1", "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    records = json.loads(done.stdout)
    result = best_rates(records, n_prompt, n_gen)
    result["build"] = f"{records[0].get('build_commit')} ({records[0].get('build_number')})"
    return result


class Ours:
    """Our offline engine on the file, loaded once, timed per request."""

    def __init__(self, model: Path, n_prompt: int, n_gen: int):
        from engine_svc import LLM

        self.llm = LLM(
            model=str(model),
            max_num_seqs=1,
            max_num_batched_tokens=max(n_prompt, 256),
            enable_prefix_caching=False,
        )
        self.vocab = self.llm.engine.spec.vocab_size
        self.n_prompt, self.n_gen = n_prompt, n_gen

    def _timed(self, prompt: list[int], max_tokens: int) -> float:
        from engine_svc import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        (out,) = self.llm.generate([prompt], sp, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if len(out.outputs[0].token_ids) != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {len(out.outputs[0].token_ids)}")
        return elapsed

    def run(self, rng: random.Random, reps: int) -> dict:
        pp = [self.n_prompt / self._timed([rng.randrange(self.vocab) for _ in range(self.n_prompt)], 1)]
        tg = [self.n_gen / self._timed([rng.randrange(self.vocab)], self.n_gen)]
        for _ in range(reps - 1):
            pp.append(
                self.n_prompt / self._timed([rng.randrange(self.vocab) for _ in range(self.n_prompt)], 1)
            )
            tg.append(self.n_gen / self._timed([rng.randrange(self.vocab)], self.n_gen))
        return {"pp": statistics.mean(pp), "tg": statistics.mean(tg)}

    def close(self) -> None:
        self.llm.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file, or a folder holding one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="llama.cpp then ours, this many times")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each test per round (llama-bench -r)")
    ap.add_argument("--llama-bench", default=str(LLAMA_BENCH))
    ap.add_argument("--quick", action="store_true", help="pp16 / tg8, one round of one repetition")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    import torch

    from engine_svc.models.model_path import resolve_model_path

    where = resolve_model_path(args.model)
    if not where.is_gguf:
        raise SystemExit(f"{args.model}: llama-bench needs a GGUF file")
    n_prompt, n_gen = (16, 8) if args.quick else (512, 128)
    rounds, reps = (1, 1) if args.quick else (args.rounds, args.reps)
    torch.set_num_threads(args.threads)
    ours = Ours(where.gguf, n_prompt, n_gen)
    rng = random.Random(0)
    ours.run(rng, 1)  # warm-up: first-shape costs, caches
    rows: list[dict] = []
    for r in range(rounds):  # alternating: both systems see the same load within a round
        peer = run_llama_bench(Path(args.llama_bench), where.gguf, args.threads, n_prompt, n_gen, reps)
        mine = ours.run(rng, reps)
        rows.append({"llamacpp": peer, "ours": mine})
        print(
            f"round {r + 1}: pp{n_prompt} ours {mine['pp']:.1f} / llama.cpp {peer['pp']:.1f} tok/s "
            f"({mine['pp'] / peer['pp']:.2f}x); tg{n_gen} ours {mine['tg']:.1f} / llama.cpp "
            f"{peer['tg']:.1f} tok/s ({mine['tg'] / peer['tg']:.2f}x)",
            file=sys.stderr,
            flush=True,
        )
    ours.close()
    result: dict = {
        "model": str(where.gguf),
        "threads": args.threads,
        "llamacpp_build": rows[0]["llamacpp"]["build"],
    }
    for key, n in (("pp", n_prompt), ("tg", n_gen)):
        name = f"{key}{n}"
        ratios = [row["ours"][key] / row["llamacpp"][key] for row in rows]
        result[name] = {
            "ours_tok_s": [row["ours"][key] for row in rows],
            "llamacpp_tok_s": [row["llamacpp"][key] for row in rows],
            "llamacpp_repack_tok_s": [row["llamacpp"]["repack"][key] for row in rows],
            "ratio_ours_to_llamacpp": ratios,
            "median_ratio": statistics.median(ratios),
        }
        print(
            f"{name}: ours {statistics.median(result[name]['ours_tok_s']):.1f} tok/s, llama.cpp "
            f"{statistics.median(result[name]['llamacpp_tok_s']):.1f} tok/s, ratio (median of "
            f"{len(ratios)} rounds) {statistics.median(ratios):.2f}"
        )
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
