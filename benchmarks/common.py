"""What every benchmark shares: the model (built once, cached), workloads, an engine driver that
timestamps every token, percentiles, targets, and the JSON result file.

Every figure a benchmark judges is a ratio against a baseline measured in the same process run:
the machines are shared and noisy, so absolute times are printed but never judged.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.machine import git_commit, machine_info
from engine_svc import EngineConfig, SamplingParams
from engine_svc.engine import LLMEngine

BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_DIR = Path(os.environ.get("LLMSERVE_BENCH_RESULTS", BENCH_DIR / "results"))

# The engine issue's benchmark model: Llama-shaped, fp32. 4096 positions so that a 2048-token
# prompt plus its outputs fits (the chunked-prefill benchmark).
FULL_SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
# --quick: the same architecture, small enough that a whole benchmark runs in seconds.
QUICK_SHAPE = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
MODEL_SEED = 0


def vocab_size(quick: bool) -> int:
    """The vocabulary of ``model_dir(quick)``'s model, for drawing random prompts."""
    return (QUICK_SHAPE if quick else FULL_SHAPE)["vocab_size"]


def model_dir(quick: bool, initializer_range: float | None = None) -> Path:
    """A real safetensors checkpoint of the benchmark shape, built once from a fixed seed and cached,
    so that the engine and HF transformers load the very same weights. ``initializer_range`` 0.02
    (HF's default scale) gives a model whose greedy outputs fall into cycles (speculation's)."""
    from engine_svc.models.build import build_random_model

    shape = dict(QUICK_SHAPE if quick else FULL_SHAPE)
    if initializer_range is not None:
        shape["initializer_range"] = initializer_range
    name = "llama-" + "-".join(f"{k[:3]}{v}" for k, v in sorted(shape.items()))
    out = CACHE_DIR / name
    stamp = out / ".complete"
    if not stamp.exists():
        # Built aside and renamed into place: a benchmark and a test may build it at the same time.
        tmp = CACHE_DIR / f".{name}.{os.getpid()}"
        # eos 1 is never reached with ignore_eos; it only has to be a valid id.
        build_random_model(tmp, "llama", seed=MODEL_SEED, eos_token_id=1, **shape)
        (tmp / ".complete").write_text(json.dumps(shape))
        try:
            tmp.rename(out)
        except OSError:  # another process got there first (or a stale, incomplete build is in the way)
            if not stamp.exists():
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_engine(model: Path, **overrides) -> LLMEngine:
    options = dict(
        block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, seed=0, dtype="float32", device="cpu"
    )
    options.update(overrides)
    return LLMEngine(EngineConfig(model=str(model), **options))


# --- workloads --------------------------------------------------------------------------------
@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run
    # The driver aborts the request after this many tokens, as the gateway does on a stop string:
    # the engine cannot know this length in advance (it is where an EOS would fall).
    stop_after: int | None = None

    @property
    def output_len(self) -> int:
        return self.stop_after or self.max_tokens


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    # Ids from 2 up: 0 and 1 are the checkpoint's special tokens.
    return [rng.randrange(2, vocab) for _ in range(length)]


def random_requests(
    n: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int,
    seed: int = 0,
    prefix: str = "r",
) -> list[Req]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(Req(f"{prefix}{i}", random_prompt(rng, plen, vocab), rng.randint(*output_range)))
    return reqs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# --- driving the engine -----------------------------------------------------------------------
@dataclass
class StepRecord:
    t: float  # seconds since the start, at the end of the step
    dt: float
    running: int
    waiting: int
    kv_used: int
    kv_total: int


@dataclass
class RunTrace:
    start: float
    end: float = 0.0
    arrival: dict[str, float] = field(default_factory=dict)  # absolute perf_counter times
    token_times: dict[str, list[float]] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_times.values())

    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def ttft(self, rid: str) -> float:
        return self.token_times[rid][0] - self.arrival[rid]

    def itls(self, rids) -> list[float]:
        out: list[float] = []
        for rid in rids:
            t = self.token_times.get(rid, [])
            out.extend(b - a for a, b in zip(t, t[1:], strict=False))
        return out


def drive(engine: LLMEngine, reqs: list[Req], on_step=None, max_steps: int = 1_000_000) -> RunTrace:
    """Add each request at its arrival time, step until everything is done, timestamp every token.

    ``on_step(engine, trace)`` runs after each step (outside the timed step)."""
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    by_id = {r.rid: r for r in reqs}
    trace = RunTrace(start=time.perf_counter())
    i = 0
    for _ in range(max_steps):
        now = time.perf_counter()
        while i < len(pending) and trace.start + pending[i].arrival_s <= now:
            r = pending[i]
            engine.add_request(r.rid, r.prompt, greedy(r.max_tokens))
            trace.arrival[r.rid] = now
            trace.token_times[r.rid] = []
            trace.prompt_tokens += len(r.prompt)
            i += 1
        if not engine.has_unfinished_requests():
            if i == len(pending):
                break
            time.sleep(max(0.0, trace.start + pending[i].arrival_s - time.perf_counter()))
            continue
        t0 = time.perf_counter()
        deltas = engine.step()
        t1 = time.perf_counter()
        for d in deltas:
            times = trace.token_times[d.request_id]
            times.extend([t1] * len(d.new_token_ids))
            limit = by_id[d.request_id].stop_after
            if limit is not None and len(times) >= limit and not d.finished:
                engine.abort_request(d.request_id)
        s = engine.stats()
        trace.steps.append(
            StepRecord(
                t1 - trace.start, t1 - t0, s.num_running, s.num_waiting, s.kv_blocks_used, s.kv_blocks_total
            )
        )
        if on_step is not None:
            on_step(engine, trace)
    else:
        raise RuntimeError(f"the engine did not finish within {max_steps} steps")
    trace.end = time.perf_counter()
    return trace


def warm_up(engine: LLMEngine, seed: int = 99) -> None:
    """A few throwaway requests (prefill and decode, one and several at once): the first torch calls of
    a process pay one-off costs that must not land in a timed run."""
    vocab = engine.spec.vocab_size
    reqs = random_requests(4, (16, 48), (4, 8), vocab, seed=seed, prefix=f"warmup{seed}-")
    drive(engine, reqs[:1])
    drive(engine, reqs[1:])
    engine.kv.pool.reset_prefix_cache()


# --- a model of fixed cost, for the benchmarks that measure everything around it --------------
class StubModel:
    """Stands in for ``DecoderForCausalLM`` in the model runner: returns preallocated tensors after a
    fixed sleep, and keeps the time spent inside it so the caller can subtract it exactly."""

    def __init__(self, spec, max_tokens: int, max_rows: int, cost_s: float = 0.0, seed: int = 0):
        self.spec = spec
        self.cost_s = cost_s
        self.hidden = torch.zeros(max_tokens, spec.hidden_size)
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(max_rows, spec.vocab_size, generator=gen)
        self.inside_s = 0.0
        self.calls = 0
        self.tokens = 0  # tokens computed, recomputes after preemption included

    def __call__(self, kernels, input_ids, positions, kv_caches, attn, lora=None):
        t0 = time.perf_counter()
        if self.cost_s:
            time.sleep(self.cost_s)
        out = self.hidden[: input_ids.shape[0]]
        self.calls += 1
        self.tokens += int(input_ids.shape[0])
        self.inside_s += time.perf_counter() - t0
        return out

    def compute_logits(self, hidden):
        # A view, not a copy: a fresh [rows, vocab] tensor per step would make the caller pay for
        # freeing it. Safe because the benchmarks' requests (greedy, no min_tokens, no penalties)
        # never make the sampler write into its logits.
        return self.logits[: hidden.shape[0]]


def install_stub_model(engine: LLMEngine, cost_s: float = 0.0) -> StubModel:
    c = engine.config
    stub = StubModel(
        engine.spec, c.max_num_batched_tokens, max(c.max_num_seqs, c.max_num_batched_tokens), cost_s
    )
    engine.runner.forward.model = stub
    return stub


# --- figures, targets and results -------------------------------------------------------------
def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def latency_summary(values) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
        "mean": float(np.mean(values)) if len(values) else float("nan")
    }


def target(name: str, value: float, op: str, threshold: float, unit: str = "", note: str = "") -> dict:
    """One judged figure: ``value op threshold`` (op is ">=" or "<=")."""
    met = value >= threshold if op == ">=" else value <= threshold
    return dict(
        name=name, value=float(value), op=op, target=float(threshold), unit=unit, met=bool(met), note=note
    )


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        mark = "met" if t["met"] else "MISSED"
        print(
            f"  {t['name']}: {t['value']:.3f}{t['unit']}  "
            f"(target {t['op']} {t['target']:g}{t['unit']})  {mark}"
        )


def thin(series: dict[str, list], keep: int = 300) -> dict[str, list]:
    """At most about ``keep`` points per time series: enough for a plot, small enough to commit."""
    return {k: v[:: max(1, len(v) // keep)] if isinstance(v, list) else v for k, v in series.items()}


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes: runs in seconds (used by the tests)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("LLMSERVE_BENCH_THREADS", "1")),
        help="torch intra-op threads for every side of every comparison (default 1, see below)",
    )
    args = p.parse_args()
    # One thread by default: on a shared machine whose other processes keep both cores busy, each
    # parallel torch op waits at a barrier for a descheduled sibling thread, and many-small-op work
    # (decode steps) slows down several fold (measured: 41 ms vs 145 ms per 16-stream decode step at a
    # load average of 5 on 2 cores). Both sides of every ratio run with the same setting.
    torch.set_num_threads(args.threads)
    return args


def begin(description: str, full: dict, quick: dict) -> tuple[argparse.Namespace, float, dict, Path]:
    """What every benchmark's main starts with: its arguments, its start time, its workload (quick
    or full) and the model checkpoint of that size."""
    args = parse_args(description)
    return args, time.perf_counter(), quick if args.quick else full, model_dir(args.quick)


def write_result(name: str, result: dict, results_dir: Path = RESULTS_DIR) -> Path:
    return write_json(results_dir / f"{name}.json", result)


def write_json(path: str | Path, doc: dict) -> Path:
    """Write ``doc`` to ``path`` whole or not at all (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def result_doc(
    name: str,
    quick: bool,
    config: dict,
    figures: dict,
    targets: list[dict],
    series: dict | None = None,
    elapsed_s: float = 0.0,
) -> dict:
    return dict(
        benchmark=name,
        quick=quick,
        config=config,
        figures=figures,
        targets=targets,
        series=series or {},
        elapsed_s=elapsed_s,
        torch_threads=torch.get_num_threads(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        commit=git_commit(),
        machine=machine_info(),
    )


def finish(
    name: str,
    args: argparse.Namespace,
    config: dict,
    figures: dict,
    targets: list[dict],
    series: dict | None,
    t_start: float,
) -> dict:
    """Print the judged figures, write ``results/NAME.json`` and return the document."""
    doc = result_doc(name, args.quick, config, figures, targets, series, time.perf_counter() - t_start)
    print(f"[{name}] {doc['elapsed_s']:.1f} s")
    print_targets(targets)
    path = write_result(name, doc, args.results_dir)
    print(f"  -> {path}")
    return doc
