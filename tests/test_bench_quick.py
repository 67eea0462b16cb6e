"""Every benchmark of the suite, run in its --quick mode in its own process, writes a result whose
figures are internally consistent. Speed is never asserted: these are timing ratios on a shared
machine; the full run (`make bench`) judges them against their targets."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernels.cpu import linear as cpu_linear

ROOT = Path(__file__).resolve().parents[1]
TARGET_KEYS = {"name", "value", "op", "target", "unit", "met", "note"}


def run_quick(name: str, results: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--results-dir", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed bound: a busy CI machine took over 240 s
    )
    assert proc.returncode == 0, (
        f"benchmarks.{name} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    doc = json.loads((results / f"{name}.json").read_text())
    assert doc["benchmark"] == name and doc["quick"] is True
    assert doc["targets"], "a benchmark must judge at least one figure"
    for t in doc["targets"]:
        assert set(t) == TARGET_KEYS
        assert math.isfinite(t["value"]) and t["op"] in (">=", "<=")
        assert t["met"] == (t["value"] >= t["target"] if t["op"] == ">=" else t["value"] <= t["target"])
    return doc


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench_results")


def test_kv_memory(results):
    f = run_quick("kv_memory", results)["figures"]
    assert 0.5 < f["paged"]["utilization"] <= 1.0
    # The contiguous allocators reserve at least what is live, so they never hold their slots better.
    assert (
        f["contiguous_max_model_len"]["utilization"]
        <= f["contiguous_prompt_plus_max_tokens"]["utilization"]
        <= 1
    )
    assert f["contiguous_max_model_len"]["mean_running_saturated"] >= 1
    assert f["concurrency_vs_max_model_len"] > f["concurrency_vs_prompt_plus_max_tokens"] > 0


def test_continuous_batching(results):
    doc = run_quick("continuous_batching", results)
    f = doc["figures"]
    useful = f["engine_continuous"]["output_tokens"]
    assert useful == f["engine_static"]["output_tokens"] == f["hf_static"]["output_tokens"] > 0
    assert f["hf_static"]["computed_tokens"] >= useful  # static batching pads to the batch's longest output
    assert f["ratio_vs_hf"] == pytest.approx(
        f["engine_continuous"]["output_tok_s"] / f["hf_static"]["output_tok_s"]
    )
    assert "vllm" in f["vllm_note"]
    assert all(0 <= u <= 1 for _, u in doc["series"]["kv_usage"])


def test_chunked_prefill(results):
    doc = run_quick("chunked_prefill", results)
    on, off = doc["figures"]["chunking_on"], doc["figures"]["chunking_off"]
    w = doc["config"]["workload"]
    assert (
        on["max_num_batched_tokens"] == w["chunk_budget"] < w["long_prompt"] <= off["max_num_batched_tokens"]
    )
    for m in (on, off):
        assert m["itl_samples"] > 0 and 0 < m["itl_s"]["p50"] <= m["itl_s"]["p99"]
        assert m["long_ttft_s"]["mean"] > 0 and m["tokens_per_s"] > 0


def test_prefix_caching(results):
    doc = run_quick("prefix_caching", results)
    f = doc["figures"]
    assert f["shared_on"]["hit_tokens"] > 0 and f["shared_off"]["hit_tokens"] == 0
    assert 0 < f["hit_rate"] <= f["best_possible_hit_rate"] + 1e-9
    assert all(r["hit_tokens"] == 0 for r in f["random_runs"]["on"])  # random prompts share no full block
    assert doc["series"]["hit_rate"]


def test_block_hashing(results):
    f = run_quick("block_hashing", results)["figures"]
    assert f["blake2b_us_per_block"] > 0 and f["blocks_hashed_per_step"] > 0
    assert 0 < f["hash_ms_per_step"] < f["step_ms_events_off"]
    assert f["event_batches"] > 0  # the subscriber got the workload's events


def test_step_overhead(results):
    doc = run_quick("step_overhead", results)
    per = doc["figures"]["per_batch"]
    assert sorted(per, key=int) == [str(n) for n in doc["config"]["workload"]["batch_sizes"]]
    cost_ms = 1e3 * doc["config"]["workload"]["stub_cost_s"]
    for m in per.values():  # the stub sleeps its cost each step: at least that is counted as the model's
        assert m["stub_ms"] >= cost_ms and m["sampler_math_ms"] > 0
    assert "scheduler.py" in doc["figures"]["profile_largest_batch"]


def test_step_overhead_recovers_each_known_cost(tiny_llama):
    """``overhead`` is the step's remainder, so ``step == stub + sampler + overhead`` holds by
    construction and proves nothing. Instead each part gets a known cost of its own: the stub model
    sleeps 10 ms, the sampler 4 ms, and the scheduler (overhead) 3 ms per step. A sleep never returns
    early, so each part must recover at least its own cost; and the parts must not take each other's:
    the stub's and the sampler's time is not overhead (the real overhead of 4 decoding requests is far
    below the margin), and the step is no longer than an outside clock saw."""
    import time

    from benchmarks import step_overhead

    stub_cost, sampler_cost, schedule_cost, steps = 0.010, 0.004, 0.003, 8
    w = dict(step_overhead.QUICK, stub_cost_s=stub_cost)
    engine, stub, sampler = step_overhead.decode_engine(tiny_llama, 4, w)
    real_sampler, real_schedule = sampler.sampler, engine.scheduler.schedule

    def sampler_of_known_cost(logits, batch):
        time.sleep(sampler_cost)
        return real_sampler(logits, batch)

    def schedule_of_known_cost():
        time.sleep(schedule_cost)
        return real_schedule()

    sampler.sampler = sampler_of_known_cost
    engine.scheduler.schedule = schedule_of_known_cost
    t0 = time.perf_counter()
    m = step_overhead.measure(engine, stub, sampler, steps)
    outside_ms = 1e3 * (time.perf_counter() - t0) / steps
    margin_ms = 5.0  # the real overhead and a shared machine's noise, per step: half the stub's cost
    assert m["stub_ms"] >= 1e3 * stub_cost, "a step's model time was not counted"
    assert m["sampler_math_ms"] >= 1e3 * sampler_cost, "a step's sampler time was not counted"
    assert m["overhead_ms"] >= 1e3 * schedule_cost, "the scheduler's time was not counted as overhead"
    assert m["overhead_ms"] <= 1e3 * schedule_cost + margin_ms, "another part's time was counted as overhead"
    assert m["step_ms"] <= outside_ms


def _flops_from_the_config(model_dir, tokens: int, sampled: int, attended_positions: int) -> float:
    """FLOPs of a step read from the checkpoint's config.json (not from the engine's weights):
    2 per multiply-add of every projection for every token, the LM head for each sampled row, and
    QK^T plus PV (2 x 2 per head dimension) for every (query, attended position) pair."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    h, inter, layers, vocab = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
    )
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    per_token = layers * (h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 2 * h * inter + inter * h)
    return (
        2.0 * per_token * tokens + 2.0 * h * vocab * sampled + 4.0 * heads * hd * attended_positions * layers
    )


class _LogitsOfKnownCost:
    """The stub model whose LM head also sleeps: the forward and the head must both be timed."""

    def __init__(self, stub, cost_s: float):
        self.stub, self.cost_s = stub, cost_s

    def __call__(self, *args, **kwargs):
        return self.stub(*args, **kwargs)

    def compute_logits(self, hidden):
        time.sleep(self.cost_s)
        return self.stub.compute_logits(hidden)


def test_compute_efficiency_counts_known_flops_and_times_a_model_of_known_cost(tiny_llama):
    """The FLOPs the benchmark counts equal a count made from the checkpoint's config (decode: 4
    requests at known positions; prefill: known prompts), and the forward time it measures is at
    least what a stub of known cost spent in its forward and its LM head, and at most the step."""
    from benchmarks import common
    from benchmarks import compute_efficiency as ce

    w = dict(ce.QUICK, decode_batch=4, decode_prompt=16, decode_steps=4, prefill_prompts=2, prefill_len=24)
    engine = common.make_engine(tiny_llama, enable_prefix_caching=False)
    shapes = ce.projection_shapes(engine.runner.forward.model)
    forward_cost, head_cost = 0.006, 0.003
    stub = common.install_stub_model(engine, forward_cost)
    timed = ce.TimedModel(_LogitsOfKnownCost(stub, head_cost))
    engine.runner.forward.model = timed
    t0 = time.perf_counter()
    decode = ce.measure_decode(engine, timed, w, shapes)
    outside = time.perf_counter() - t0
    # The prompt (16 tokens) and the first token are computed before the timed steps: step k's query
    # is position 17 + k, attending 18 + k positions, in each of the 4 requests.
    want = sum(_flops_from_the_config(tiny_llama, 4, 4, 4 * (18 + k)) for k in range(4)) / 4
    assert decode["flops"] == pytest.approx(want, rel=1e-12)
    assert decode["forward_s"] >= forward_cost + head_cost, "the LM head's or the forward's time was lost"
    assert decode["forward_s"] <= decode["step_s"] <= outside / w["decode_steps"]
    prefill = ce.measure_prefill(engine, timed, w, shapes)
    n = w["prefill_len"]
    want = _flops_from_the_config(tiny_llama, 2 * n, 2, 2 * n * (n + 1) // 2)
    assert prefill["flops"] == pytest.approx(want, rel=1e-12)
    assert prefill["forward_s"] >= forward_cost + head_cost


def test_compute_efficiency_judges_known_figures_against_the_fastest_gemm():
    """Known FLOPs and times in, the rates and efficiencies worked out by hand out."""
    from benchmarks import compute_efficiency as ce

    m = ce.rates_from(flops=6e9, steps=3, wall_s=1.5, inside_s=0.75)
    assert (m["flops"], m["step_s"], m["forward_s"]) == (2e9, 0.5, 0.25)
    assert (m["step_flop_s"], m["forward_flop_s"]) == (4e9, 8e9)
    for prepacked, native, best, baseline in (
        (None, 16e9, "native GEMM", 16e9),
        (10e9, None, "prepacked oneDNN", 10e9),
        (None, None, "plain matmul", 2e9),
    ):
        fig = dict(m, matmul_flop_s=2e9, prepacked_flop_s=prepacked, native_flop_s=native)
        ce.judge(fig)
        assert (fig["baseline"], fig["baseline_flop_s"]) == (best, baseline)
        assert fig["step_efficiency"] == pytest.approx(4e9 / baseline)
        assert fig["forward_efficiency"] == pytest.approx(8e9 / baseline)
        assert fig["step_efficiency_vs_plain_matmul"] == pytest.approx(2.0)


def test_compute_efficiency(results):
    f = run_quick("compute_efficiency", results)["figures"]
    for phase in ("decode", "prefill"):
        m = f[phase]
        assert m["flops"] > 0 and m["matmul_flop_s"] > 0 and m["step_s"] > 0
        assert 0 < m["step_efficiency"] and math.isfinite(m["forward_efficiency"])


def test_speculative(results):
    f = run_quick("speculative", results)["figures"]
    for name in ("batch1_ngram", "concurrency4_ngram", "batch1_draft_model", "batch1_never_right"):
        assert f[name]["drafted"] > 0, name
        assert 0.0 <= f[name]["acceptance"] <= 1.0
        assert len(f[name]["ratios"]) >= 1 and f[name]["speedup"] > 0
    assert f["batch1_ngram"]["acceptance"] > 0.3  # the cycling model gives n-gram lookup something
    assert f["batch1_never_right"]["acceptance"] < 0.1  # the forced-wrong proposer is wrong


def test_run_all_writes_report_with_plots(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run_all",
            "--quick",
            "--results-dir",
            str(tmp_path),
            "--only",
            "kv_memory",
            "prefix_caching",
            "serving",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed bound: a busy CI machine took over 240 s
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert set(latest["benchmarks"]) == {"kv_memory", "prefix_caching", "serving"}
    assert latest["benchmarks"]["kv_memory"]["status"] == "ok"
    report = (tmp_path / "REPORT.md").read_text()
    assert "live tokens / allocated KV slots" in report and "hit rate / best possible" in report
    for png in ("targets.png", "kv_usage.png", "prefix_hit_rate.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in report
    # The serving benchmark's own --quick checks, on the result run_all had it write (its only run
    # in the suite: a second run in test_bench_service_quick cost ~50 s of a 2-core CI's time).
    assert latest["benchmarks"]["serving"]["status"] == "ok"
    check_serving_quick(json.loads((tmp_path / "serving.json").read_text()))


def check_serving_quick(r: dict) -> None:
    """benchmarks.serving --quick: both levels, every path error-free with finite figures, and the
    gRPC and HTTP clients given the same requests delivered the same tokens."""
    assert [row["concurrency"] for row in r["levels"]] == [1, 4]
    assert r["transport"] == "grpc"  # the default transport
    for row in r["levels"]:
        for path in ("service", "http", "offline"):
            assert row[path]["errors"] == 0
            assert finite(row[path]["output_tok_s"], row[path]["itl_p50_ms"], row[path]["ttft_p50_ms"])
        assert finite(row["throughput_ratio"], row["http_over_grpc_throughput"])
        # the same requests: both APIs delivered every token (wall_s is rounded to 1 ms)
        tokens = {p: row[p]["output_tok_s"] * row[p]["wall_s"] for p in ("service", "http")}
        assert row["http"]["requests"] == row["service"]["requests"]
        assert tokens["http"] == pytest.approx(tokens["service"], rel=0.01)


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_lora(results):
    doc = run_quick("lora", results)
    f = doc["figures"]
    runs = f["runs"]
    tokens = {side: {r["tokens"] for r in rs} for side, rs in runs.items()}
    assert tokens["base"] == tokens["adapters"] == tokens["separate"], (
        "every side must produce the same tokens"
    )
    pairs = zip(runs["adapters"], runs["base"], strict=True)
    assert f["adapters_vs_base"] == [a["tok_s"] / b["tok_s"] for a, b in pairs]
    # Mixed: one batch for every adapter; separate: each adapter's requests apart, so more steps.
    assert all(s["steps"] > a["steps"] for s, a in zip(runs["separate"], runs["adapters"], strict=True))


def test_cpu_kernels(results):
    f = run_quick("cpu_kernels", results)["figures"]
    # every shape on every instruction set this CPU runs, and every fused kernel at each size
    shapes = {r["shape"] for r in f["attention"]}
    assert len(shapes) == 4 and {r["isa"] for r in f["attention"]} == set(f["isas"])
    assert f["chosen_isa"] == f["isas"][0]
    assert {(r["kernel"], r["tokens"]) for r in f["elementwise"]} == {
        (k, t) for k in ("rms_norm + residual", "rotary", "silu_and_mul") for t in (1, 16)
    }
    for r in f["attention"] + f["elementwise"]:
        assert r["native_ms"] > 0 and r["torch_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["native_ms"])
    if cpu_linear.onednn_unusable_reason(torch.device("cpu"), torch.float32) is None:
        assert {(r["weight"], r["m"]) for r in f["gemm"]} == {(w, m) for w in ("qkv", "down") for m in (1, 8)}
        for r in f["gemm"]:
            assert r["native_ms"] > 0 and r["speedup"] == pytest.approx(r["onednn_ms"] / r["native_ms"])
