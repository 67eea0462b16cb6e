"""Prompt processing and generation at depth, as ``llama-bench -d`` measures them: pp512 and tg128
after a context of D tokens (D = 0, 4096, 16384 by default), ours against llama.cpp on the same
GGUF file, two threads each.

    python -m benchmarks.long_context --model models/qwen2.5-coder-0.5b [--depths 0,4096,16384]
        [--rounds 2] [--reps 1] [--no-llamacpp] [--out FILE]

llama.cpp: ``llama-bench -d DEPTHS -p 512 -n 128 -r REPS --repack 0,1 -o json``, the better of
repacking off and on per test and depth (llama-bench fills the depth's context, then times the
test on top of it). Ours: the offline engine with prefix caching, loaded once; per depth a context
of D random token ids is prefilled once, untimed (a request generating one token), so that its
blocks sit in the prefix cache; then pp512 is one request of that context plus 512 new random ids
generating one token (the context is a cache hit, prefilled again untimed before each timed
request: the step computes the 512, attending to all D + 512 positions; 512 over the request's
wall time), and tg128 one request of the context plus one
new id generating 128 with eos ignored (128 over the wall time: the new id's step and 127 decodes,
each attending to the depth). The systems alternate round by round (llama.cpp, then ours); on a
shared machine only the ratios within a round mean anything. ``--no-llamacpp`` runs ours alone (to
compare two builds of ours, alternate runs of this script from each tree).

``--quick``: depths 0 and 64, pp16 / tg8, one round: the harness in seconds.
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

from benchmarks.llamacpp_bench import LLAMA_BENCH


def depth_rates(records: list[dict], depths: list[int], n_prompt: int, n_gen: int) -> dict:
    """From ``llama-bench -o json`` records: ``{depth: {"pp": tok/s, "tg": tok/s}}``, the best
    ``avg_ts`` over the repack settings of each test at each depth; a missing one is an error."""
    out: dict = {}
    for d in depths:
        out[d] = {}
        for key, want in (("pp", (n_prompt, 0)), ("tg", (0, n_gen))):
            rows = [
                r for r in records
                if (int(r["n_prompt"]), int(r["n_gen"])) == want and int(r.get("n_depth", 0)) == d
            ]  # fmt: skip
            if not rows:
                raise ValueError(f"llama-bench printed no {key}{max(want)} result at depth {d}")
            out[d][key] = max(float(r["avg_ts"]) for r in rows)
    return out


def run_llama_bench(binary: Path, model: Path, threads: int, depths: list[int], n_prompt: int, n_gen: int,
                    reps: int) -> dict:  # fmt: skip
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing: `make bench-peer` builds it")
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-d", ",".join(map(str, depths)), "-r", str(reps), "--repack", "0,1", "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return depth_rates(json.loads(done.stdout), depths, n_prompt, n_gen)


class OursAtDepth:
    """Our offline engine on the file with prefix caching, loaded once."""

    def __init__(self, model: Path, depths: list[int], n_prompt: int, n_gen: int, seed: int = 0):
        from engine_svc import LLM

        longest = max(depths) + n_prompt + n_gen + 16
        self.llm = LLM(
            model=str(model),
            max_num_seqs=1,
            max_model_len=longest + 64,
            max_num_batched_tokens=max(n_prompt, 2048),
            enable_prefix_caching=True,
        )
        vocab = self.llm.engine.spec.vocab_size
        self.rng = random.Random(seed)
        self.vocab, self.n_prompt, self.n_gen = vocab, n_prompt, n_gen
        self.contexts = {d: self._ids(d) for d in depths}
        self.cached: list[int] = []  # each request's prompt tokens found cached, in order

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _timed(self, prompt: list[int], max_tokens: int) -> float:
        from engine_svc import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        (out,) = self.llm.generate([prompt], sp, use_tqdm=False)
        elapsed = time.perf_counter() - start
        self.cached.append(out.num_cached_tokens)  # of the prompt, found in the prefix cache
        if len(out.outputs[0].token_ids) != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {len(out.outputs[0].token_ids)}")
        return elapsed

    def prefill(self, depth: int) -> float:
        """Puts the depth's context in the prefix cache (untimed by the caller's figures)."""
        ctx = self.contexts[depth]
        return self._timed(ctx, 1) if ctx else 0.0

    def run(self, depth: int, reps: int) -> dict:
        """pp and tg at the depth. Before each timed request the depth's context is prefilled again,
        untimed: the pool holds one longest sequence (the CPU default), and the other depths' and
        tests' requests may have evicted some of its cached blocks, which a timed request would
        recompute (without it, round 1 at 4096 read 157 tok/s where round 2 read 326). Where it is
        still cached that costs one token's step. llama-bench likewise restores the depth's state
        before each repetition. ``cached`` records each request's prompt tokens found cached."""
        ctx = self.contexts[depth]
        pp, tg = [], []
        for _ in range(reps):
            self.prefill(depth)
            pp.append(self.n_prompt / self._timed(ctx + self._ids(self.n_prompt), 1))
            self.prefill(depth)
            tg.append(self.n_gen / self._timed(ctx + self._ids(1), self.n_gen))
        return {"pp": statistics.mean(pp), "tg": statistics.mean(tg)}

    def close(self) -> None:
        self.llm.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file, or a folder holding one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("--rounds", type=int, default=2, help="llama.cpp then ours, this many times")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each test per round")
    ap.add_argument("--llama-bench", default=str(LLAMA_BENCH))
    ap.add_argument("--no-llamacpp", action="store_true", help="ours alone")
    ap.add_argument("--quick", action="store_true", help="depths 0 and 64, pp16 / tg8, one round")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    import torch

    from engine_svc.models.model_path import resolve_model_path

    where = resolve_model_path(args.model)
    if not where.is_gguf:
        raise SystemExit(f"{args.model}: llama-bench needs a GGUF file")
    depths = [0, 64] if args.quick else [int(d) for d in args.depths.split(",")]
    n_prompt, n_gen = (16, 8) if args.quick else (512, 128)
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    ours = OursAtDepth(where.gguf, depths, n_prompt, n_gen)
    setup = {d: ours.prefill(d) for d in depths}
    print(
        f"ours: contexts prefilled ({', '.join(f'{d}: {s:.1f} s' for d, s in setup.items())})",
        file=sys.stderr,
    )
    ours.run(depths[0], 1)  # warm-up: first-shape costs
    rows: list[dict] = []
    for r in range(rounds):
        peer = None
        if not args.no_llamacpp:
            peer = run_llama_bench(Path(args.llama_bench), where.gguf, args.threads, depths, n_prompt, n_gen,
                                   args.reps)  # fmt: skip
        mine = {}
        for d in depths:
            ours.cached.clear()
            mine[d] = ours.run(d, args.reps)
            mine[d]["cached"] = list(ours.cached)
        rows.append({"llamacpp": peer, "ours": mine})
        for d in depths:
            line = f"round {r + 1} depth {d}: pp{n_prompt} ours {mine[d]['pp']:.1f}, "
            line += f"tg{n_gen} ours {mine[d]['tg']:.2f} (cached, prefill/pp/prefill/tg: {mine[d]['cached']})"
            if peer:
                line += (
                    f"; llama.cpp pp {peer[d]['pp']:.1f} ({mine[d]['pp'] / peer[d]['pp']:.2f}x), "
                    f"tg {peer[d]['tg']:.2f} ({mine[d]['tg'] / peer[d]['tg']:.2f}x)"
                )
            print(line + " tok/s", file=sys.stderr, flush=True)
    ours.close()
    result: dict = {"model": str(where.gguf), "threads": args.threads, "depths": {}}
    for d in depths:
        fig: dict = {}
        for key, n in (("pp", n_prompt), ("tg", n_gen)):
            name = f"{key}{n}"
            fig[name] = {"ours_tok_s": [row["ours"][d][key] for row in rows]}
            if not args.no_llamacpp:
                ratios = [row["ours"][d][key] / row["llamacpp"][d][key] for row in rows]
                fig[name]["llamacpp_tok_s"] = [row["llamacpp"][d][key] for row in rows]
                fig[name]["ratio_ours_to_llamacpp"] = ratios
                fig[name]["median_ratio"] = statistics.median(ratios)
        result["depths"][str(d)] = fig
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
