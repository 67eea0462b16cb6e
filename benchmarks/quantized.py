"""Batch-1 decode: llmserve on a GGUF file (its quantized blocks, or dequantized to fp32 / bf16)
against llama.cpp on the same file, the same prompt token ids, greedy, a fixed output length.

Both sides run the same harness: each prompt alone from an empty cache, output tokens over the
wall time of the whole request (prefill + decode). llama.cpp runs in its own venv
(``benchmarks/.llamacpp-venv``, ``make bench-peer``) as a subprocess speaking JSON lines
(``benchmarks/llamacpp_peer.py``); it is loaded once and kept, so that the systems can alternate
(A B A B ...) inside one run: on a shared machine only ratios measured that way mean anything.

    python -m benchmarks.quantized [--model models/default] [--rounds 2] [--tokens 128]
        [--systems ours:auto,ours:float32,ours:bfloat16,llamacpp]

``--batched`` runs every prompt at once instead: ours in one ``generate`` call, llama.cpp through
its C API with all sequences in one unified KV cache (``llamacpp_peer.py``); ``--tokens-range
32,256`` spreads the output lengths evenly over the prompts. ``--llamacpp-flash-attn`` and
``--llamacpp-n-batch`` set llama.cpp's batched step. The Q8_0 file of the same weights comes from
``python -m benchmarks.requantize_gguf models/default --type Q8_0`` (pass it as ``--model``).

A system ``ours:DTYPE[:ACTIVATIONS]`` is llmserve with that dtype (``auto``: the file's blocks) and
``quantized_activations`` (``int8`` or ``none``; unset: the engine's default), e.g.
``ours:auto:int8,ours:auto:none,llamacpp``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine_svc.models.model_path import resolve_model_path
from tokenizer_svc.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = ROOT / "benchmarks" / ".llamacpp-venv" / "bin" / "python"
CORPUS = ROOT / "tokenizer_svc" / "corpus" / "multilingual.txt"


def prompt_ids(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut from the repository's corpus."""
    ids = tokenizer.encode(CORPUS.read_text(encoding="utf-8"))
    if isinstance(ids, dict) or hasattr(ids, "ids"):
        ids = list(getattr(ids, "ids", ids))
    if len(ids) < length + count:
        raise ValueError(f"the corpus has {len(ids)} tokens: too few for {count} prompts of {length}")
    # Windows at distinct offsets, wrapping around the corpus: distinct prompts, no prefix shared.
    step = max(1, (len(ids) - length) // count)
    return [list(ids[(i * step) % (len(ids) - length) :][:length]) for i in range(count)]


def _has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class LlamaCpp:
    """llama.cpp's Python binding in its own venv, one model held across rounds."""

    def __init__(self, model: Path, threads: int, repack: bool, batched: bool = False, **batch_options):
        if not LLAMACPP_PYTHON.exists():
            raise FileNotFoundError(f"{LLAMACPP_PYTHON} missing: run `make bench-peer`")
        self.batched, self.batch_options = batched, batch_options
        self.proc = subprocess.Popen(
            [str(LLAMACPP_PYTHON), str(ROOT / "benchmarks" / "llamacpp_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.repack = repack
        self._send({"model": str(model), "threads": threads, "n_ctx": 1024, "repack": repack})
        self.name = "llama.cpp" + (" batched" if batched else "")
        self.version = self._recv(timeout_s=600)["version"]

    def _send(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _recv(self, timeout_s: float) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer exited ({self.proc.poll()})")
        return json.loads(line)

    def run(self, prompts, max_tokens):
        job = {"prompts": prompts, "max_tokens": max_tokens}
        if self.batched:
            job.update(batched=True, **self.batch_options)
        self._send(job)
        r = self._recv(timeout_s=1800)
        return r["outputs"], r["total_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Ours:
    def __init__(self, model: Path, dtype: str | None, batched: bool = False, activations=None, **options):
        from engine_svc.llm import LLM

        self.name = f"llmserve {dtype or 'auto'}" + (f" {activations}-act" if activations else "")
        if activations:
            options["quantized_activations"] = activations
        self.batched = batched
        self.llm = LLM(model=str(model), dtype=dtype, max_num_seqs=256 if batched else 1, **options)

    def run(self, prompts, max_tokens):
        from engine_svc.sampling_params import SamplingParams

        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
        sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in limits]
        cpu = time.process_time()
        if self.batched:  # every prompt in one generate call: the engine batches them
            start = time.perf_counter()
            rs = self.llm.generate(prompts, sps, use_tqdm=False)
            self.cpu_s = time.process_time() - cpu
            return [list(r.outputs[0].token_ids) for r in rs], [time.perf_counter() - start]
        outs, times = [], []
        for p, sp in zip(prompts, sps, strict=True):
            start = time.perf_counter()
            (r,) = self.llm.generate([p], sp, use_tqdm=False)
            times.append(time.perf_counter() - start)
            outs.append(list(r.outputs[0].token_ids))
        self.cpu_s = time.process_time() - cpu
        return outs, times

    def close(self) -> None:
        self.llm.shutdown()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--systems", default="ours:auto,ours:float32,ours:bfloat16,llamacpp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--batched", action="store_true", help="all prompts at once (llama.cpp: one unified KV cache)"
    )
    ap.add_argument(
        "--tokens-range", default=None, help="A,B: output lengths spread from A to B over the prompts"
    )
    ap.add_argument("--llamacpp-n-batch", type=int, default=512)
    ap.add_argument("--llamacpp-flash-attn", action="store_true")
    ap.add_argument(
        "--llamacpp-repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp's weight repacking; auto: off on a CPU with AMX, where 0.3.36 crashes with it",
    )
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    where = resolve_model_path(args.model)
    systems = []
    for s in args.systems.split(","):
        if s == "llamacpp":
            options = dict(n_batch=args.llamacpp_n_batch, flash_attn=args.llamacpp_flash_attn)
            repack = {"on": True, "off": False}.get(args.llamacpp_repack, not _has_amx())
            systems.append(LlamaCpp(where.gguf, args.threads, repack, batched=args.batched, **options))
        else:
            _, dtype, *act = s.split(":")
            model = where.gguf if where.is_gguf else where.root
            systems.append(
                Ours(
                    model,
                    None if dtype == "auto" else dtype,
                    batched=args.batched,
                    activations=act[0] if act else None,
                )
            )
    tok = load_tokenizer(where.gguf if where.is_gguf else where.root)  # llama.cpp alone needs one too
    prompts = prompt_ids(tok, args.prompts, args.prompt_len)
    limits = args.tokens
    if args.tokens_range:
        lo, hi = (int(x) for x in args.tokens_range.split(","))
        n = len(prompts)
        limits = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    for s in systems:  # warm-up: builds, caches, first-shape costs
        s.run(prompts[:1], 8)
    rates: dict[str, list[float]] = {s.name: [] for s in systems}
    # Our systems also per CPU-second of this process (on a machine shared with other work, less
    # sensitive than wall time to the share of the cores we got; llama.cpp runs in another process)
    cpu_rates: dict[str, list[float]] = {s.name: [] for s in systems if isinstance(s, Ours)}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):  # A B C A B C: every system sees the same machine load
        for s in systems:
            outs, times = s.run(prompts, limits)
            rates[s.name].append(sum(len(o) for o in outs) / sum(times))
            if s.name in cpu_rates:
                cpu_rates[s.name].append(sum(len(o) for o in outs) / s.cpu_s)
            tokens[s.name] = outs
            print(f"{s.name}: {rates[s.name][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    for s in systems:
        s.close()
    result = {"rates_tok_s": rates, "median_tok_s": {k: statistics.median(v) for k, v in rates.items()}}
    result["llamacpp_repack"] = next((s.repack for s in systems if isinstance(s, LlamaCpp)), None)
    names = list(rates)
    base = next((n for n in names if n.startswith("llama.cpp")), names[-1])
    result["ratio_vs_" + base] = {k: result["median_tok_s"][k] / result["median_tok_s"][base] for k in names}
    # Per round ratios (the same round's load for both): the honest spread.
    result["round_ratios_vs_" + base] = {
        k: [a / b for a, b in zip(rates[k], rates[base], strict=True)] for k in names
    }
    result["tok_per_cpu_s"] = cpu_rates
    result["median_tok_per_cpu_s"] = {k: statistics.median(v) for k, v in cpu_rates.items()}
    ref = tokens.get("llmserve float32")
    if ref is not None:
        result["greedy_equal_to_fp32"] = {
            k: sum(a == b for a, b in zip(v, ref, strict=True)) for k, v in tokens.items()
        }
        result["requests"] = len(ref)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
