"""``results/REPORT.md`` and its PNG plots from the benchmarks' JSON results: a stamp (commit, date,
machine), the headline figures against the peer, every judged figure next to its target (a missed
one says so), then throughput against concurrency, latency percentiles, KV usage over time and the
prefix-cache hit rate.

``python -m benchmarks.report`` rebuilds ``latest.json`` and the report from the result files
already in ``benchmarks/results/`` (no benchmark runs) and writes the headline table into the
README between its markers, so that the README quotes the report and nothing is copied by hand.

Our benchmarks carry their targets in their JSON; the service benchmarks (serving, transports,
tokenizer workers) write their own layout, read here by small adapters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, target, write_result
from benchmarks.machine import REPO, describe, git_commit, machine_info
from benchmarks.registry import REGISTRY

README_BEGIN = "<!-- headline table: written by python -m benchmarks.report; do not edit -->"
README_END = "<!-- end of headline table -->"

PLOT_STYLE = dict(figsize=(6.0, 3.4), dpi=80)


# --- targets ----------------------------------------------------------------------------------
def service_targets(name: str, doc: dict) -> list[dict]:
    """The service issue's targets, from the service benchmarks' own JSON layouts."""
    out: list[dict] = []
    if name == "serving":
        for row in doc.get("levels", []):
            c = row["concurrency"]
            out.append(
                target(
                    f"service / offline engine throughput, concurrency {c}",
                    row["throughput_ratio"],
                    ">=",
                    0.9,
                    "x",
                )
            )
            out.append(
                target(
                    f"added p50 inter-token latency, concurrency {c}",
                    row["added_itl_p50_ms"],
                    "<=",
                    1.0,
                    " ms",
                )
            )
            if "http_over_grpc_throughput" in row:  # reported, not judged
                out.append(
                    informational(
                        f"OpenAI HTTP / gRPC throughput, concurrency {c}",
                        row["http_over_grpc_throughput"],
                        "x",
                        "the same requests through the same gateway",
                    )
                )
    elif name == "transports" and "throughput_ratio_shm_over_grpc" in doc:
        out.append(
            informational(
                "throughput, shared-memory ring / plain gRPC",
                doc["throughput_ratio_shm_over_grpc"],
                "x",
                f"faster: {doc.get('faster')}",
            )
        )
    elif name == "tokenizer_workers" and "itl_p99_ratio_without_over_with" in doc:
        out.append(
            informational(
                "p99 ITL without / with tokenizer workers",
                doc["itl_p99_ratio_without_over_with"],
                "x",
                "above 1: the workers keep long prompts from stalling the streams",
            )
        )
    return out


def informational(name: str, value: float, unit: str, note: str) -> dict:
    return dict(name=name, value=float(value), op=None, target=None, unit=unit, met=None, note=note)


def targets_of(name: str, doc: dict) -> list[dict]:
    return doc["targets"] if "targets" in doc else service_targets(name, doc)


def format_value(t: dict) -> str:
    return "missing" if t["value"] is None else f"{t['value']:.3g}{t['unit']}"


def verdict(t: dict) -> str:
    """met / **MISSED**; a judged figure without a value (its peer did not run) is **MISSING**, never met."""
    if t["op"] is not None and t["value"] is None:
        return "**MISSING**"
    return "" if t["met"] is None else ("met" if t["met"] else "**MISSED**")


def target_table(latest: dict) -> list[str]:
    lines = ["| benchmark | figure | measured | target | |", "| --- | --- | --- | --- | --- |"]
    for name, run in latest["benchmarks"].items():
        if run["result"] is None:
            lines.append(f"| {name} | — | {run['status']} | | |")
            continue
        for t in targets_of(name, run["result"]):
            goal = "—" if t["op"] is None else f"{t['op']} {t['target']:g}{t['unit']}"
            note = f" ({t['note']})" if t.get("note") else ""
            lines.append(f"| {name} | {t['name']}{note} | {format_value(t)} | {goal} | {verdict(t)} |")
    return lines


# --- plots ------------------------------------------------------------------------------------
def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=PLOT_STYLE["figsize"])
    return plt, fig, ax


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_STYLE["dpi"])
    plt.close(fig)
    return path.name


def plot_targets(latest: dict, out: Path) -> str | None:
    """Each judged figure as a fraction of its target (1 = exactly on target; right of 1 = better)."""
    rows = []
    for name, run in latest["benchmarks"].items():
        for t in targets_of(name, run["result"]) if run["result"] else []:
            if t["op"] is None or not t["target"] or t["value"] is None:
                continue
            v = t["value"]
            score = v / t["target"] if t["op"] == ">=" else (t["target"] / v if v > 0 else 10.0)
            rows.append((f"{name}: {t['name']}"[:60], min(score, 10.0), t["met"]))
    if not rows:
        return None
    plt, fig, ax = _figure()
    fig.set_size_inches(7.5, 0.28 * len(rows) + 1.0)
    labels = [r[0] for r in rows][::-1]
    ax.barh(
        labels, [r[1] for r in rows][::-1], color=["tab:green" if r[2] else "tab:red" for r in rows][::-1]
    )
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("measured / target (log; >= 1 meets it; red = missed)")
    ax.tick_params(axis="y", labelsize=7)
    return _save(plt, fig, out / "targets.png")


def plot_concurrency(latest: dict, out: Path) -> str | None:
    run = latest["benchmarks"].get("serving", {})
    doc = run.get("result")
    if not doc or not doc.get("levels"):
        return None
    plt, fig, ax = _figure()
    levels = doc["levels"]
    xs = [row["concurrency"] for row in levels]
    for path, style in (("service", "o-"), ("offline", "s--")):
        ax.plot(xs, [row[path]["output_tok_s"] for row in levels], style, label=path)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("serving: throughput against concurrency")
    ax.legend()
    return _save(plt, fig, out / "throughput_concurrency.png")


def plot_latency(latest: dict, out: Path) -> str | None:
    groups = []
    chunked = (latest["benchmarks"].get("chunked_prefill") or {}).get("result")
    if chunked:
        f = chunked["figures"]
        groups += [
            ("ITL, chunking on", f["chunking_on"]["itl_s"]),
            ("ITL, chunking off", f["chunking_off"]["itl_s"]),
        ]
    cont = (latest["benchmarks"].get("continuous_batching") or {}).get("result")
    if cont:
        groups.append(("ITL, 64-request batch run", cont["series"]["itl_s"]))
    prefix = (latest["benchmarks"].get("prefix_caching") or {}).get("result")
    if prefix:
        f = prefix["figures"]
        groups += [
            ("TTFT, prefix cache on", f["shared_on_baseline_set"]["ttft_s"]),
            ("TTFT, prefix cache off", f["shared_off"]["ttft_s"]),
        ]
    if not groups:
        return None
    plt, fig, ax = _figure()
    fig.set_size_inches(7.0, 3.6)
    width = 0.27
    for k, q in enumerate(("p50", "p90", "p99")):
        ax.bar([i + (k - 1) * width for i in range(len(groups))], [g[1][q] for g in groups], width, label=q)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=7, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title("latency percentiles")
    ax.legend()
    return _save(plt, fig, out / "latency_percentiles.png")


def plot_kv(latest: dict, out: Path) -> str | None:
    kv = (latest["benchmarks"].get("kv_memory") or {}).get("result")
    cont = (latest["benchmarks"].get("continuous_batching") or {}).get("result")
    if not kv and not cont:
        return None
    plt, fig, ax = _figure()

    def plot(points, label):
        # The runs last from seconds (stub model) to minutes: each on its own fraction-of-run axis.
        end = points[-1][0] or 1.0
        ax.plot([t / end for t, _ in points], [v for _, v in points], label=label)

    if kv:
        s = kv["series"]
        plot(s["kv_usage"], "kv_memory (256 requests, fixed budget): blocks in use / total")
        plot(s["live_over_allocated"], "kv_memory: live tokens / allocated slots")
    if cont:
        plot(cont["series"]["kv_usage"], "continuous_batching (64 requests): blocks in use / total")
    ax.set_xlabel("fraction of the run")
    ax.set_ylim(0, 1.05)
    ax.set_title("KV cache over time")
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "kv_usage.png")


def plot_prefix(latest: dict, out: Path) -> str | None:
    prefix = (latest["benchmarks"].get("prefix_caching") or {}).get("result")
    if not prefix or not prefix["series"].get("hit_rate"):
        return None
    plt, fig, ax = _figure()
    s = prefix["series"]
    ax.plot(*zip(*s["hit_rate"], strict=True), label="hit tokens / queried tokens (cumulative)")
    ax.axhline(s["best_possible_hit_rate"], color="black", ls="--", label="best possible")
    ax.axhline(0.95 * s["best_possible_hit_rate"], color="tab:red", ls=":", label="target: 0.95 of best")
    ax.set_xlabel("seconds into the run")
    ax.set_ylim(0, 1.05)
    ax.set_title("prefix cache: 64 requests sharing a 1024-token system prompt")
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "prefix_hit_rate.png")


def plot_routing(latest: dict, out: Path) -> str | None:
    routing = (latest["benchmarks"].get("routing") or {}).get("result")
    if not routing or not routing["series"].get("kv_blocks"):
        return None
    plt, fig, ax = _figure()
    s = routing["series"]
    for policy, style in (("prefix-affinity", "o-"), ("round-robin", "s--")):
        ax.plot(s["kv_blocks"], s[policy], style, label=policy)
    ax.axhline(s["best_possible_hit_rate"], color="black", ls=":", label="best possible")
    ax.set_xlabel("KV blocks per replica (2 replicas)")
    ax.set_ylabel("prefix hit tokens / queried")
    ax.set_ylim(0, 1.05)
    w = routing["config"]["workload"]
    ax.set_title(f"routing: {w['num_prompts']} system prompts, {w['num_requests']} requests")
    ax.legend(fontsize=7)
    return _save(plt, fig, out / "routing_hit_rate.png")


# --- the headline: llmserve against the peer ----------------------------------------------------
OFFLINE_LABELS = {
    "random": "64 requests, prompts 32-512, outputs 16-256 (output tok/s)",
    "long_tail": "128 requests, prompts 8-128, long-tailed outputs (output tok/s)",
    "shared_prefix": "64 requests sharing a 1024-token prefix, 32 out each (seconds)",
}


def headline_table(latest: dict) -> list[str]:
    """The peer comparison in two small tables (offline, serving), from ``peer.json``."""
    peer = (latest["benchmarks"].get("peer") or {}).get("result")
    if not peer:
        return ["No peer result in this report (`make bench-peer`, then `python -m benchmarks.peer`)."]
    f, doc = peer["figures"], peer
    if not f.get("vllm"):
        return [f"The peer did not run: {f.get('peer_note')}."]
    version = f["vllm"].get("_meta", {}).get("version", "?")
    where = describe(doc["machine"]) if doc.get("machine") else "machine not recorded in the result file"
    out = [
        f"llmserve against vLLM {version} (CPU build), same model (55M-parameter Llama shape, fp32) and "
        f"the same token ids; `python -m benchmarks.peer`, result of {doc.get('time')} ({where}). "
        "Higher is better for every ratio except TTFT and ITL (lower is better).",
        "",
        "| offline workload | vLLM | llmserve default | ratio | llmserve 1 thread | ratio (matched) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    ratios = f.get("ratios", {})
    for name, label in OFFLINE_LABELS.items():
        if name not in f["vllm"] or not f.get("ours_default"):
            continue
        key, unit = ("wall_s", " s") if name == "shared_prefix" else ("output_tok_s", "")
        out.append(
            f"| {label} | {f['vllm'][name][key]:.1f}{unit} | {f['ours_default'][name][key]:.1f}{unit} | "
            f"**{ratios[name + '_ours_default']:.2f}x** | {f['ours_matched'][name][key]:.1f}{unit} | "
            f"**{ratios[name + '_ours_matched']:.2f}x** |"
        )
    out += [
        "",
        "| serving (streams at once) | vLLM OpenAI, tok/s | llmserve gRPC, tok/s | ratio | "
        "llmserve OpenAI, ratio | TTFT p99 ratio | ITL p99 ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    sr = f.get("serving_ratios", {})
    for c, theirs in sorted((f.get("serving_vllm") or {}).items(), key=lambda kv: int(kv[0])):
        ours, grpc_r = f["serving_ours"][c], sr[f"serving_ours_c{c}"]
        http_r = sr.get(f"serving_ours_http_c{c}")
        http = f"{http_r['output_tok_s']:.2f}x" if http_r else "not run"
        out.append(
            f"| concurrency {c} | {theirs['output_tok_s']:.1f} | {ours['output_tok_s']:.1f} | "
            f"**{grpc_r['output_tok_s']:.2f}x** | {http} | {grpc_r['ttft_p99_ms']:.2f}x | "
            f"{grpc_r['itl_p99_ms']:.2f}x |"
        )
    return out


def readme_block(latest: dict) -> str:
    return "\n".join([README_BEGIN, *headline_table(latest), README_END])


def update_readme(latest: dict, readme: Path) -> bool:
    """Replace the README's headline block with this report's; False when the README has no markers."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(head + readme_block(latest) + tail)
    return True


# --- the report -------------------------------------------------------------------------------
def stamp(latest: dict) -> list[str]:
    m = latest["machine"]
    how = (
        "rebuilt from the result files already there (no benchmark ran; each result's own time is in "
        "the Runs table)"
        if latest.get("report_only")
        else f"{'quick mode, ' if latest['quick'] else ''}whole suite {latest['elapsed_s'] / 60:.1f} min, "
        f"load average before {m['load_average_before'][0]:.1f}, after {m['load_average_after'][0]:.1f}"
    )
    whose = (
        " of this report (each result names its own in the Runs table, where it records one)"
        if latest.get("report_only")
        else ""
    )
    return [
        f"- Commit: `{latest.get('commit', 'unknown')}`",
        f"- Date: {latest['time']}",
        f"- Machine{whose}: {describe(m)}; {m['torch_threads']} torch thread(s) per benchmark side",
        f"- How: {how}",
    ]


def write_report(latest: dict, out: Path, plots: bool = True) -> Path:
    lines = [
        "# Benchmark report",
        "",
        "Generated by `benchmarks/report.py`; do not edit by hand.",
        "",
        *stamp(latest),
        "",
        "Every judged figure is a ratio against a baseline measured in the same run; absolute times are "
        "printed by each benchmark and kept in `latest.json`, never judged. A missed target is marked "
        "**MISSED**. The machine is shared: a load average above the CPU count means other processes "
        "competed for the cores during the run.",
        "",
        "## Headline: llmserve against vLLM",
        "",
        *headline_table(latest),
        "",
        "## Targets",
        "",
        *target_table(latest),
        "",
    ]
    if plots:
        lines += ["## Plots", ""]
        for title, fn in (
            ("Each figure against its target", plot_targets),
            ("Throughput against concurrency (serving)", plot_concurrency),
            ("Latency percentiles", plot_latency),
            ("KV usage over time", plot_kv),
            ("Prefix-cache hit rate", plot_prefix),
            ("Prefix hit rate across 2 replicas, by routing", plot_routing),
        ):
            png = fn(latest, out)
            lines += [f"### {title}", "", f"![{title}]({png})" if png else "(no data in this run)", ""]
    lines += [
        "## Runs",
        "",
        "| benchmark | status | seconds | commit of the result | machine of the result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for n, r in latest["benchmarks"].items():
        doc = r["result"] or {}
        machine = describe(doc["machine"]) if doc.get("machine") else "not recorded"
        commit = doc.get("commit", "not recorded")
        lines.append(f"| {n} | {r['status']} | {r['elapsed_s']:.0f} | {commit} | {machine} |")
    lines += ["", *details(latest)]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def details(latest: dict) -> list[str]:
    """The figures behind the ratios, briefly, for the benchmarks that need them to be read."""
    out = ["## Details", ""]
    b = latest["benchmarks"]
    cont = (b.get("continuous_batching") or {}).get("result")
    if cont:
        f = cont["figures"]
        out.append(
            f"- continuous batching: engine {f['engine_continuous']['output_tok_s']:.1f} output tok/s, "
            f"engine static batches {f['engine_static']['output_tok_s']:.1f}, HF static batches "
            f"{f['hf_static']['output_tok_s']:.1f}; vLLM: {f.get('vllm_note')}."
        )
    kv = (b.get("kv_memory") or {}).get("result")
    if kv:
        f = kv["figures"]
        p = f["paged"]
        out.append(
            f"- KV memory: {p['mean_running_saturated']:.1f} requests at once paged "
            f"({p.get('mean_running_charged', float('nan')):.1f} charged for {p['preemptions']} preemptions, "
            f"{p.get('recomputed_tokens', 0)} tokens recomputed); contiguous: "
            + ", ".join(
                f"{k.removeprefix('contiguous_')} {v['mean_running_saturated']:.1f}"
                for k, v in f.items()
                if k.startswith("contiguous_")
            )
            + " (max_model_len: the labelled best case)."
        )
    step = (b.get("step_overhead") or {}).get("result")
    if step:
        mixed = step["figures"].get("mixed")
        if mixed:
            out.append(
                f"- step overhead, mixed (joins {mixed['joins_per_step']:.1f} and leaves "
                f"{mixed['leaves_per_step']:.1f} per step, temperature + top-p, {mixed['mean_running']:.0f} "
                f"running): {mixed['overhead_ms']:.3f} ms outside the model "
                f"(+ {mixed['sampler_math_ms']:.3f} ms sampler math). Below, all decode: the best case."
            )
        for n, m in step["figures"]["per_batch"].items():
            out.append(
                f"- step overhead at {n} running: {m['overhead_ms']:.3f} ms outside the model "
                f"(+ {m['sampler_math_ms']:.3f} ms sampler math, stub {m['stub_ms']:.2f} ms)."
            )
    eff = (b.get("compute_efficiency") or {}).get("result")
    if eff:
        for phase in ("decode", "prefill"):
            m = eff["figures"][phase]
            out.append(
                f"- {phase}: {m['step_flop_s'] / 1e9:.1f} GFLOP/s per step, {m['forward_flop_s'] / 1e9:.1f} "
                f"in the forward alone, plain matmul {m['matmul_flop_s'] / 1e9:.1f}."
            )
    peer = (b.get("peer") or {}).get("result")
    if peer:
        out += peer_details(peer["figures"])
    routing = (b.get("routing") or {}).get("result")
    if routing:
        f = routing["figures"]
        rr, aff = f["runs"]["round-robin"], f["runs"]["prefix-affinity"]
        out.append(
            f"- routing ({f['driver']}): prefix hit rate {aff['hit_rate']:.3f} with prefix affinity, "
            f"{rr['hit_rate']:.3f} round-robin (best possible {f['best_possible_hit_rate']:.3f}); "
            f"{aff['tokens_per_cpu_s']:.0f} vs {rr['tokens_per_cpu_s']:.0f} tokens per CPU-second "
            f"({f['throughput_ratio']:.2f}x); requests per replica {aff['requests_per_replica']}."
        )
    return out


def peer_details(f: dict) -> list[str]:
    """The side-by-side figures with vLLM's CPU build (or a line saying the peer is missing)."""
    out = [f"- vLLM peer: {f.get('peer_note')}."]
    peer = f.get("vllm")
    rows = ["", "| workload | vLLM | llmserve default | llmserve matched | ratio default / matched |"]
    rows.append("| --- | ---: | ---: | ---: | ---: |")
    offline = (("random", "output_tok_s"), ("long_tail", "output_tok_s"), ("shared_prefix", "wall_s"))
    for name, key in offline if f.get("ours_default") else ():  # --serving-only: no offline figures
        unit = " s" if key == "wall_s" else " tok/s"
        ours = [f[side][name][key] for side in ("ours_default", "ours_matched")]
        ratios = f.get("ratios", {})
        cells = [
            f"{peer[name][key]:.1f}{unit}" if peer else "missing",
            *(f"{v:.1f}{unit}" for v in ours),
            " / ".join(
                f"{ratios[f'{name}_{side}']:.2f}x" if f"{name}_{side}" in ratios else "missing"
                for side in ("ours_default", "ours_matched")
            ),
        ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    for api, label in (("serving_ours", "gRPC"), ("serving_ours_http", "OpenAI HTTP")):
        for c, ours in (f.get(api) or {}).items():
            theirs = (f.get("serving_vllm") or {}).get(c)
            fmt = "{output_tok_s:.1f} tok/s, TTFT p99 {ttft_p99_ms:.0f} ms, ITL p99 {itl_p99_ms:.1f} ms"
            rows.append(
                f"| serving c={c}, ours via {label} | {fmt.format(**theirs) if theirs else 'missing'} | "
                f"{fmt.format(**ours)} | – | "
                + (f"{ours['output_tok_s'] / theirs['output_tok_s']:.2f}x |" if theirs else "missing |")
            )
    return out + rows + [""]


# --- from the stored result files -------------------------------------------------------------
def stored_run(name: str, results_dir: Path) -> dict:
    """One benchmark's entry in ``latest.json`` from its result file, as ``run_all`` makes it."""
    path = results_dir / f"{name}.json"
    if not path.exists():
        return dict(status="no result file", elapsed_s=0.0, result=None)
    doc = json.loads(path.read_text())
    written = doc.get("time", "a time it does not record")
    return dict(status=f"ok (result of {written})", elapsed_s=doc.get("elapsed_s", 0.0), result=doc)


def collect(results_dir: Path = RESULTS_DIR, threads: int = 1) -> dict:
    """``latest.json`` rebuilt from the result files (the machine is this one: the report's own)."""
    return dict(
        time=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        quick=False,
        report_only=True,
        elapsed_s=0.0,
        commit=git_commit(),
        machine=dict(**machine_info(), torch_threads=threads),
        benchmarks={name: stored_run(name, results_dir) for name, _ in REGISTRY},
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--readme", type=Path, default=REPO / "README.md", help="whose headline block to update")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args()
    latest = collect(args.results_dir)
    write_result("latest", latest, args.results_dir)
    report = write_report(latest, args.results_dir, plots=not args.no_plots)
    updated = update_readme(latest, args.readme) if args.readme.exists() else False
    print(f"wrote {report}" + (f" and the headline block of {args.readme}" if updated else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
