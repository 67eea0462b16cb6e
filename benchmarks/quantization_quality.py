"""How much each quantized path changes the model, measured the way llama.cpp's ``perplexity
--kl-divergence`` does: the same token windows run through a reference model and through each
measured path, and at every scored position the full next-token distributions compared.

- Windows: ``n_ctx`` tokens each (default 512), each from an empty KV cache; only the second half
  of a window is scored (positions ``n_ctx/2`` .. ``n_ctx-2``, each predicting the next token), as
  llama.cpp does, so every scored token has at least ``n_ctx/2`` tokens of context.
- Texts: ``english``, Python's own documentation (``pydoc_data.topics``, read at run time from the
  interpreter's stdlib, never copied here: its figures depend on the Python version, which the
  report names), and ``multilingual``, the repository's corpus (``tokenizer_svc/corpus``).
- Reference: ``--reference`` (default ``models/default``) dequantized to fp32
  (``quantization="none"``). Measured: each ``--model`` file (default: that file and its Q8_0
  copy, ``benchmarks/requantize_gguf.py``) on each ``--paths`` entry (the file's own blocks with
  int8 or fp32 activations, int8 but the LM head on fp32, or blocks made at load);
  ``--fp32-kinds`` puts more linear kinds back on fp32 activations, to find where the KL comes
  from; ``--kv-cache-dtype bfloat16`` runs the measured paths on a bf16 KV cache (``gguf-fp32``
  then measures the cache's rounding alone); ``--attention-dtype bfloat16`` adds attention's bf16
  products on that cache.
- Per text and path: mean KL(reference || measured) with its standard error, the 99.9th percentile
  and max of the per-position KL, top-1 agreement, perplexity (and the reference's), and the number
  of scored positions.
- ``--llamacpp``: the same windows through llama.cpp (``benchmarks/llamacpp_logprobs.py`` in
  ``benchmarks/.llamacpp-venv``) on each ``--model`` file and on an F32 file of the reference's
  weights; each compared with llama.cpp's own F32 run and with ours.

    python -m benchmarks.quantization_quality [--model FILE ...] [--reference FILE] [--windows 6]
        [--n-ctx 512] [--texts english,multilingual] [--paths gguf-int8,gguf-fp32] [--llamacpp]

Our full distributions are the engine's own prompt-logprob logits rows (``our_logprobs``), so
nothing here re-implements the model.

``--llama-perplexity``: llama.cpp's ``llama-perplexity`` itself (``benchmarks/.llamacpp/bin``): its
``--kl-divergence-base`` run on the reference's F32 file (the file dequantized exactly) stores the
windows it tokenized, then ``--kl-divergence`` on ``--model`` prints its mean KL; ours runs the same
windows (read from that file) through our fp32 load of the reference and each ``--paths`` entry.

    python -m benchmarks.quantization_quality --llama-perplexity --reference FILE --windows 4 \
        --paths gguf-int8
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine_svc.llm import LLM
from engine_svc.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tokenizer_svc" / "corpus" / "multilingual.txt"
LLAMACPP_PYTHON = ROOT / "benchmarks" / ".llamacpp-venv" / "bin" / "python"
PATHS = {  # name: (quantization, quantized_activations, linear kinds kept on fp32 activations)
    "gguf-int8": ("gguf", "int8", ()),
    "gguf-int8-fp32-head": ("gguf", "int8", ("lm_head",)),
    "gguf-fp32": ("gguf", "none", ()),
    "int8-at-load": ("int8", "none", ()),
    "int8-at-load-int8": ("int8", "int8", ()),
    "int4-at-load": ("int4", "none", ()),
    "int4-at-load-int8": ("int4", "int8", ()),
}
TEXTS = ("english", "multilingual")


def english_text(chars: int) -> str:
    """The first ``chars`` characters of the interpreter's own documentation topics."""
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics.values())[:chars]


def text_windows(tokenizer, name: str, n_ctx: int, count: int) -> list[list[int]]:
    """Up to ``count`` consecutive, non-overlapping windows of ``n_ctx`` tokens of the text (at
    least one: a text shorter than one window is one shorter window)."""
    # ~4 characters a token in English; ask for twice that so ``count`` windows fit
    text = english_text(8 * n_ctx * count) if name == "english" else CORPUS.read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    ids = list(getattr(ids, "ids", ids))
    n = max(1, min(count, len(ids) // n_ctx))
    return [ids[i * n_ctx : (i + 1) * n_ctx] for i in range(n)]


def first_scored(window: list[int]) -> int:
    """The first scored position: the second half of the window, as llama.cpp's perplexity."""
    return len(window) // 2


def targets(window: list[int]) -> torch.Tensor:
    """The tokens the scored positions predict."""
    return torch.tensor(window[first_scored(window) + 1 :])


def our_logprobs(llm: LLM, windows: list[list[int]], vocab: int) -> list[torch.Tensor]:
    """Per window, ``[scored positions, vocab]`` fp32 log-probabilities of the next token. Each
    window is its own request (an empty KV cache: no prefix cache under prompt logprobs). The rows
    are the engine's own prompt-logprob logits (``model_runner``'s ``prompt_logprobs`` call), taken
    as one tensor as they pass: the full vocabulary as Python lists held ~3 GB a 512-token window
    at Qwen2.5's 151,936 tokens."""
    from engine_svc import model_runner

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    listed = model_runner.prompt_logprobs
    out = []
    for window in windows:
        rows: list[torch.Tensor] = []

        def capture(logits, next_ids, top_n, rows=rows):
            rows.append(logits.float().log_softmax(dim=-1))
            return listed(logits, next_ids, top_n)

        model_runner.prompt_logprobs = capture
        try:
            llm.generate([window], sp, use_tqdm=False)
        finally:
            model_runner.prompt_logprobs = listed
        # row i is the distribution at position i (predicting token i + 1), in chunk order
        lp = torch.cat(rows)
        if lp.shape != (len(window) - 1, vocab):
            raise RuntimeError(f"prompt logits {tuple(lp.shape)}, expected {(len(window) - 1, vocab)}")
        out.append(lp[first_scored(window) :].clone())
    return out


def llamacpp_logprobs(model: Path, windows: list[list[int]], n_ctx: int, threads: int) -> list[torch.Tensor]:
    """The same as ``our_logprobs`` from llama.cpp (``benchmarks/llamacpp_logprobs.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = {
            "model": str(model),
            "threads": threads,
            "n_ctx": n_ctx,
            "first": first_scored(windows[0]),
            "windows": windows,
            "out": tmp,
        }
        if len({len(w) for w in windows}) != 1:
            raise ValueError("llama.cpp's windows must all have one length")
        done = subprocess.run(
            [str(LLAMACPP_PYTHON), str(ROOT / "benchmarks" / "llamacpp_logprobs.py")],
            input=json.dumps(job) + "\n",
            capture_output=True,
            text=True,
            check=True,
        )
        files = json.loads(done.stdout.strip().splitlines()[-1])["files"]
        return [torch.from_numpy(np.load(f, allow_pickle=False)) for f in files]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], windows: list[list[int]]) -> dict:
    """KL(ref || got) per scored position, over all windows, and the figures llama.cpp reports."""
    kls, same, nll, nll_ref = [], [], [], []
    for r, g, w in zip(ref, got, windows, strict=True):
        r, g = r.double(), g.double()
        p = r.exp()
        kls.append(torch.where(p > 0, p * (r - g), torch.zeros_like(p)).sum(1))
        same.append(r.argmax(1) == g.argmax(1))
        t = targets(w)[:, None]
        nll.append(-g.gather(1, t).squeeze(1))
        nll_ref.append(-r.gather(1, t).squeeze(1))
    kl, nll, nll_ref = torch.cat(kls), torch.cat(nll), torch.cat(nll_ref)
    return {
        "positions": len(kl),
        "mean_kl": kl.mean().item(),
        "mean_kl_stderr": (kl.std() / math.sqrt(len(kl))).item() if len(kl) > 1 else 0.0,
        "kl_99_9": torch.quantile(kl, 0.999).item(),
        "max_kl": kl.max().item(),
        "top1_agreement": torch.cat(same).double().mean().item(),
        "perplexity": math.exp(nll.mean().item()),
        "reference_perplexity": math.exp(nll_ref.mean().item()),
    }


def model_vocab(model: str) -> int:
    from engine_svc.models.gguf_checkpoint import GGUFCheckpoint
    from engine_svc.models.model_path import resolve_model_path

    where = resolve_model_path(model)
    if where.is_gguf:
        return GGUFCheckpoint(where.gguf).config()["vocab_size"]
    return json.loads((where.root / "config.json").read_text())["vocab_size"]


def gguf_file(model: str) -> Path:
    from engine_svc.models.model_path import resolve_model_path

    where = resolve_model_path(model)
    if where.gguf is None:
        raise SystemExit(f"{model}: no .gguf file there")
    return where.gguf


def default_models(reference: str) -> list[str]:
    from benchmarks.requantize_gguf import requantize

    return [reference, str(requantize(gguf_file(reference), "Q8_0"))]


def engine(
    model: str,
    quantization: str,
    activations: str,
    vocab: int,
    threads: int | None,
    fp32_kinds=(),
    kv_cache_dtype: str = "auto",
    attention_dtype: str = "auto",
    max_model_len: int = 1024,
) -> LLM:
    """An engine for one path. ``fp32_kinds``: linear kinds (``qkv``, ``o``, ``gate_up``, ``down``,
    ``lm_head``) put back on fp32 activations after an int8 load, for the ablations that find where
    the int8 path's KL comes from (the engine itself has no such option)."""
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(
        model=model,
        quantization=quantization,
        quantized_activations=activations,
        max_logprobs=vocab,
        max_num_seqs=1,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        attention_dtype=None if attention_dtype == "auto" else attention_dtype,
    )
    if fp32_kinds:
        from engine_svc.models.model_path import resolve_model_path

        m, load = llm.engine.model, llm.engine.runtime.load
        if load.quantized_activations != "int8" or load.quantization != "gguf":
            raise ValueError("fp32_kinds needs a GGUF file's blocks on int8 activations")
        put_on_fp32_activations(m, resolve_model_path(model).gguf, tuple(fp32_kinds))
    return llm


LINEAR_KINDS = ("qkv", "o", "gate_up", "down", "lm_head")


def put_on_fp32_activations(model, gguf_path: str | Path, kinds: tuple[str, ...]) -> str:
    """For this benchmark's ablations (the engine has no such option): in a loaded model,
    run the linears of ``kinds`` (``LINEAR_KINDS``) on fp32 activations, rebuilt from the file's
    blocks read again (the load freed the float weights and the blocks it packed). Returns what
    moved, e.g. ``fp32 activations: 1 x Q8_0 lm_head``."""
    unknown = [k for k in kinds if k not in LINEAR_KINDS]
    if unknown:
        raise ValueError(f"fp32 kinds: unknown {unknown} (one of {LINEAR_KINDS})")
    from collections import Counter

    from engine_svc.models.quantized_weights import EMBED, gguf_blocks
    from kernels.cpu import quant_gemm

    blocks, _ = gguf_blocks(model, gguf_path)
    moved: Counter = Counter()
    for key, qw in blocks.items():
        kind = key.rsplit(".", 1)[-1].removesuffix("_weight")
        if key == EMBED or kind not in kinds:
            continue
        if key == "lm_head":
            model.lm_head_proj = quant_gemm.QuantLinear(qw)
        else:
            layer = model.layers[int(key.split(".")[1])]
            bias = layer.qkv_bias if kind == "qkv" else None
            setattr(layer, f"{kind}_proj", quant_gemm.QuantLinear(qw, bias))
        moved[f"{qw.fmt} {kind}"] += 1
    return "fp32 activations: " + ", ".join(f"{n} x {f}" for f, n in sorted(moved.items()))


LLAMA_PERPLEXITY = ROOT / "benchmarks" / ".llamacpp" / "bin" / "llama-perplexity"
KLD_MAGIC = b"_logits_"


def kld_tokens(path: Path) -> tuple[int, int, list[list[int]]]:
    """(n_ctx, n_vocab, windows) from a ``llama-perplexity --kl-divergence-base`` file: its header
    (the magic, then n_ctx, n_vocab, n_chunk as int32) and the n_chunk x n_ctx token ids it scored."""
    with open(path, "rb") as f:
        if f.read(len(KLD_MAGIC)) != KLD_MAGIC:
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), "<i4").tolist()
        ids = np.frombuffer(f.read(4 * n_ctx * n_chunk), "<i4").reshape(n_chunk, n_ctx)
    return n_ctx, n_vocab, ids.tolist()


def run_llama_perplexity(args: list[str]) -> str:
    if not LLAMA_PERPLEXITY.exists():
        raise SystemExit(f"{LLAMA_PERPLEXITY} missing: `make bench-peer` builds it")
    done = subprocess.run([str(LLAMA_PERPLEXITY), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout + done.stderr


def llama_mean_kld(output: str) -> tuple[float, float]:
    """llama-perplexity's ``Mean    KLD:   x ±  y`` line."""
    import re

    m = re.search(r"Mean\s+KLD:\s+([-\d.e]+)\s+±\s+([-\d.e]+)", output)
    if not m:
        raise ValueError(f"no mean KLD in llama-perplexity's output: {output[-1000:]}")
    return float(m.group(1)), float(m.group(2))


def perplexity_kl(args) -> dict:
    """``--llama-perplexity``: the file's mean KL against its exact dequantization, by each engine on
    the same windows (llama.cpp tokenizes the text and stores the windows in its base file; ours
    reads them from there)."""
    from benchmarks.requantize_gguf import requantize

    threads = args.threads or torch.get_num_threads()
    (model,) = args.model or [args.reference]
    f32 = requantize(gguf_file(args.reference), "F32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        # ~4 characters a token; llama-perplexity wants 2 n_ctx tokens at least
        text.write_text(english_text(8 * args.n_ctx * (args.windows + 1)))
        common = ["-c", str(args.n_ctx), "--chunks", str(args.windows), "-t", str(threads)]
        out = run_llama_perplexity(
            ["-m", str(f32), "-f", str(text), *common, "--kl-divergence-base", str(base)]
        )
        if not base.exists() or base.stat().st_size <= len(KLD_MAGIC) + 12:
            raise RuntimeError(f"llama-perplexity wrote no base file: {out[-1000:]}")
        out = run_llama_perplexity(
            ["-m", str(gguf_file(model)), *common, "--kl-divergence-base", str(base), "--kl-divergence"]
        )
        peer, peer_err = llama_mean_kld(out)
        n_ctx, n_vocab, windows = kld_tokens(base)
    vocab = model_vocab(args.reference)
    llm = engine(args.reference, "none", "none", vocab, args.threads)
    ref = our_logprobs(llm, windows, vocab)
    llm.shutdown()
    paths = [p for p in args.paths.split(",") if PATHS[p][0] == "gguf"]
    for name in paths:
        quant, activations, kinds = PATHS[name]
        llm = engine(model, quant, activations, vocab, args.threads, kinds if activations == "int8" else ())
        figures = compare(ref, our_logprobs(llm, windows, vocab), windows)
        llm.shutdown()
        rows.append({"measured": f"ours {name}", **figures, "ratio_to_llamacpp": figures["mean_kl"] / peer})
        print(
            f"ours {name}: mean KL {figures['mean_kl']:.5f} ± {figures['mean_kl_stderr']:.5f} "
            f"({figures['mean_kl'] / peer:.2f}x llama.cpp's)",
            file=sys.stderr,
            flush=True,
        )
    rows.append(
        {
            "measured": "llama.cpp (llama-perplexity --kl-divergence)",
            "mean_kl": peer,
            "mean_kl_stderr": peer_err,
        }
    )
    print(f"llama.cpp: mean KL {peer:.5f} ± {peer_err:.5f}", file=sys.stderr)
    result = {
        "model": gguf_file(model).name,
        "reference": f"{f32.name} (each engine's own fp32 run of it)",
        "windows": len(windows),
        "n_ctx": n_ctx,
        "n_vocab": n_vocab,
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    """The report as one markdown table per text."""
    lines = []
    for text, rows in result["texts"].items():
        lines += [
            f"\n{text} ({rows['windows']} x {rows['n_ctx']} tokens, second halves scored)",
            "| reference | measured | positions | mean KL | KL 99.9% | max KL | top-1 | PPL (ref) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in rows["rows"]:
            lines.append(
                f"| {e['reference']} | {e['measured']} | {e['positions']} | "
                f"{e['mean_kl']:.5f} ± {e['mean_kl_stderr']:.5f} | {e['kl_99_9']:.4f} | "
                f"{e['max_kl']:.4f} | {e['top1_agreement']:.4f} | "
                f"{e['perplexity']:.3f} ({e['reference_perplexity']:.3f}) |"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", default=str(ROOT / "models" / "default"))
    ap.add_argument("--model", action="append", default=None, help="a measured file (repeat for more)")
    ap.add_argument(
        "--paths", default="gguf-int8,gguf-int8-fp32-head,gguf-fp32", help=f"comma list of {list(PATHS)}"
    )
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=6, help="windows of each text, at most")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--fp32-kinds",
        default="",
        help="comma list of linear kinds (qkv, o, gate_up, down, lm_head) kept on fp32 activations on "
        "every int8-activation path: an ablation",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the measured paths' KV cache (bfloat16: what its rounding adds; the reference keeps fp32)",
    )
    ap.add_argument(
        "--attention-dtype",
        default="auto",
        help="the measured paths' attention products (bfloat16: on a bf16 cache; the reference keeps fp32)",
    )
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the same windows")
    ap.add_argument(
        "--llama-perplexity",
        action="store_true",
        help="llama.cpp's own `llama-perplexity --kl-divergence` (benchmarks/.llamacpp) on --model against "
        "--reference dequantized exactly (an F32 file), and ours on the same windows (read back from its "
        "base file): each engine against its own fp32 run",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.llama_perplexity:
        return perplexity_kl(args)
    paths = args.paths.split(",")
    texts = args.texts.split(",")
    for name in paths:
        if name not in PATHS:
            ap.error(f"--paths: unknown {name!r} (one of {list(PATHS)})")
    for name in texts:
        if name not in TEXTS:
            ap.error(f"--texts: unknown {name!r} (one of {list(TEXTS)})")
    if args.n_ctx < 4:
        ap.error("--n-ctx must be at least 4")
    extra_fp32 = tuple(k for k in args.fp32_kinds.split(",") if k)
    models = args.model or default_models(args.reference)
    vocab = model_vocab(args.reference)

    context = max(1024, args.n_ctx + 1)  # a prompt needs room for one generated token
    llm = engine(args.reference, "none", "none", vocab, args.threads, max_model_len=context)
    tokenizer = llm.get_tokenizer()
    windows = {t: text_windows(tokenizer, t, args.n_ctx, args.windows) for t in texts}
    ref = {t: our_logprobs(llm, w, vocab) for t, w in windows.items()}
    llm.shutdown()
    ref_name = f"{gguf_file(args.reference).name} as fp32"
    rows: dict[str, list] = {t: [] for t in texts}

    def add(text: str, reference: str, measured: str, figures: dict) -> None:
        rows[text].append({"reference": reference, "measured": measured, **figures})
        print(text, reference, "|", measured, json.dumps(figures), file=sys.stderr, flush=True)

    for model in models:
        for name in paths:
            quant, activations, kinds = PATHS[name]
            kinds = tuple(dict.fromkeys(kinds + extra_fp32)) if activations == "int8" else ()
            if quant != "gguf" and model != models[0]:
                continue  # blocks made at load come from the same float weights whatever the file
            llm = engine(
                model,
                quant,
                activations,
                vocab,
                args.threads,
                kinds,
                args.kv_cache_dtype,
                args.attention_dtype,
                context,
            )
            label = f"ours {gguf_file(model).name} {name}" + (
                f" (fp32: {','.join(kinds)})" if extra_fp32 else ""
            )
            label += f", KV cache {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
            label += f", attention {args.attention_dtype}" if args.attention_dtype != "auto" else ""
            for t, w in windows.items():
                add(t, ref_name, label, compare(ref[t], our_logprobs(llm, w, vocab), w))
            llm.shutdown()

    if args.llamacpp:
        from benchmarks.requantize_gguf import requantize

        threads = args.threads or torch.get_num_threads()
        f32 = requantize(gguf_file(args.reference), "F32")
        for t, w in windows.items():
            peer_ref = llamacpp_logprobs(f32, w, args.n_ctx, threads)
            add(t, ref_name, f"llama.cpp {f32.name}", compare(ref[t], peer_ref, w))
            for model in models:
                got = llamacpp_logprobs(gguf_file(model), w, args.n_ctx, threads)
                add(
                    t,
                    f"llama.cpp {f32.name}",
                    f"llama.cpp {gguf_file(model).name}",
                    compare(peer_ref, got, w),
                )
                add(t, ref_name, f"llama.cpp {gguf_file(model).name}", compare(ref[t], got, w))

    result = {
        "python": sys.version.split()[0],
        "texts": {t: {"windows": len(w), "n_ctx": args.n_ctx, "rows": rows[t]} for t, w in windows.items()},
    }
    print(table(result), file=sys.stderr)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
