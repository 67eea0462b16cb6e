"""llama.cpp's next-token log-probabilities over windows of token ids, for the quality benchmark
(``benchmarks/quantization_quality.py --llamacpp``): run inside ``benchmarks/.llamacpp-venv`` as a
subprocess; it never imports llmserve.

Protocol: one JSON line on stdin, ``{"model": path, "threads": n, "n_ctx": n, "first": k,
"windows": [[ids]], "out": dir}``. Each window is evaluated from an empty KV cache in one context of
``n_ctx`` (``logits_all``: every position's logits, as llama.cpp's ``perplexity`` reads them), and
the log-softmax (float64, stored as float32) of positions ``first`` .. ``len - 2`` is written to
``dir/<window>.npy`` (numpy's own format, no pickle). One JSON line answers:
``{"files": [...], "version": ...}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import llama_cpp
    import numpy as np

    job = json.loads(sys.stdin.readline())
    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_ctx=job["n_ctx"],
        n_batch=job["n_ctx"],
        n_ubatch=job["n_ctx"],
        logits_all=True,
        verbose=False,
    )
    out = Path(job["out"])
    files = []
    for i, window in enumerate(job["windows"]):
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[job["first"] : len(window) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        path = out / f"{i}.npy"
        np.save(path, logp.astype(np.float32), allow_pickle=False)
        files.append(str(path))
    print(json.dumps({"files": files, "version": llama_cpp.__version__}), flush=True)


if __name__ == "__main__":
    main()
