"""llama.cpp's side of a batch-1 comparison, run inside ``benchmarks/.llamacpp-venv`` (``make
bench-peer``) as a subprocess of ``benchmarks/quantized.py``: it never imports llmserve.

Protocol: JSON lines. The first line on stdin is ``{"model": path, "threads": n, "n_ctx": n}``
(the model is loaded once); every further line is ``{"prompts": [[ids]], "max_tokens": n}`` and is
answered with one line ``{"outputs": [[ids]], "decode_s": [s], "total_s": [s]}``: greedy tokens,
eos ignored, each prompt alone (batch 1) from an empty KV cache. ``decode_s`` runs from the first
sampled token to the last, the same span our side times. No pickle: token ids only.
"""

from __future__ import annotations

import json
import sys
import time


def _generate(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    llm.reset()
    start = time.perf_counter()
    out: list[int] = []
    first = None
    # temp=0: llama.cpp's greedy sampler (argmax); the loop stops on our count, not on eos.
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter()
        out.append(int(tok))
        if len(out) >= max_tokens:
            break
    end = time.perf_counter()
    return out, end - (first or end), end - start


def main() -> None:
    import llama_cpp

    setup = json.loads(sys.stdin.readline())
    llm = llama_cpp.Llama(
        model_path=setup["model"],
        n_threads=setup["threads"],
        n_threads_batch=setup["threads"],
        n_ctx=setup.get("n_ctx", 1024),
        n_batch=512,
        verbose=False,
        logits_all=False,
    )
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        outs, decode, total = [], [], []
        for prompt in job["prompts"]:
            o, d, t = _generate(llm, prompt, job["max_tokens"])
            outs.append(o)
            decode.append(d)
            total.append(t)
        print(json.dumps({"outputs": outs, "decode_s": decode, "total_s": total}), flush=True)


if __name__ == "__main__":
    main()
