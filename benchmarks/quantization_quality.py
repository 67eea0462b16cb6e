"""How much each quantized path changes the model, measured like llama.cpp's ``perplexity
--kl-divergence``: on the same text (windows of the repository's corpus), against the fp32 model
(here the GGUF file dequantized to fp32, ``quantization="none"``), per path (weights, and fp32 or
int8 activations on the quantized linears: ``quantized_activations``): mean KL(fp32 || quant)
over every position's full next-token distribution, top-1 agreement, and perplexity; and whether
greedy continuations equal fp32's.

    python -m benchmarks.quantization_quality [--model models/default] [--windows 2] [--window 128]

The full distributions come from the engine's prompt logprobs with ``max_logprobs`` = the vocabulary,
so nothing here re-implements the model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from engine_svc.llm import LLM
from engine_svc.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tokenizer_svc" / "corpus" / "multilingual.txt"
PATHS = {  # name: (quantization, quantized_activations)
    "fp32": ("none", "none"),
    "gguf blocks, fp32 activations": ("gguf", "none"),
    "gguf blocks, int8 activations": ("gguf", "int8"),
    "int8 (Q8_0 made at load)": ("int8", "none"),
    "int8 (Q8_0 made at load), int8 activations": ("int8", "int8"),
    "int4 (Q4_1 made at load)": ("int4", "none"),
    "int4 (Q4_1 made at load), int8 activations": ("int4", "int8"),
}


def distributions(llm: LLM, windows: list[list[int]], vocab: int) -> torch.Tensor:
    """[positions, vocab] log-probabilities of the next token at each position after the first."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab)
    rows = []
    for r in llm.generate(windows, sp, use_tqdm=False):
        for entry in r.prompt_logprobs[1:]:
            row = torch.full((vocab,), -math.inf, dtype=torch.float64)
            row[torch.tensor(entry.top_ids)] = torch.tensor(entry.top_logprobs, dtype=torch.float64)
            rows.append(row)
    return torch.stack(rows)


def model_vocab(model: str) -> int:
    from engine_svc.models.gguf_checkpoint import GGUFCheckpoint
    from engine_svc.models.model_path import resolve_model_path

    where = resolve_model_path(model)
    if where.is_gguf:
        return GGUFCheckpoint(where.gguf).config()["vocab_size"]
    return json.loads((where.root / "config.json").read_text())["vocab_size"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result: dict = {}
    ref = ref_greedy = targets = None
    vocab = model_vocab(args.model)
    for name, (quant, activations) in PATHS.items():
        llm = LLM(
            model=args.model,
            quantization=quant,
            quantized_activations=activations,
            max_logprobs=vocab,
            max_num_seqs=4,
        )
        if targets is None:
            ids = llm.get_tokenizer().encode(CORPUS.read_text(encoding="utf-8"))
            ids = list(getattr(ids, "ids", ids))
            windows = [ids[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
            targets = torch.tensor([t for w in windows for t in w[1:]])
        logp = distributions(llm, windows, vocab)
        sp = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True)
        greedy = [
            list(r.outputs[0].token_ids) for r in llm.generate([w[:32] for w in windows], sp, use_tqdm=False)
        ]
        llm.shutdown()
        nll = -logp.gather(1, targets[:, None]).squeeze(1)
        entry = {"perplexity": math.exp(nll.mean().item())}
        if ref is None:
            ref, ref_greedy = logp, greedy
        else:
            p = ref.exp()
            kl = torch.where(p > 0, p * (ref - logp), torch.zeros_like(p)).sum(1)
            entry.update(
                mean_kl=kl.mean().item(),
                max_kl=kl.max().item(),
                top1_agreement=(ref.argmax(1) == logp.argmax(1)).double().mean().item(),
                logprobs_bit_equal=bool(torch.equal(ref, logp)),
                greedy_equal=sum(a == b for a, b in zip(greedy, ref_greedy, strict=True)),
                greedy_of=len(greedy),
            )
        result[name] = entry
        print(name, json.dumps(entry), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
