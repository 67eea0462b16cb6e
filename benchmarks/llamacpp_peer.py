"""llama.cpp's side of a batch-1 comparison, run inside ``benchmarks/.llamacpp-venv`` (``make
bench-peer``) as a subprocess of ``benchmarks/quantized.py``: it never imports llmserve.

Protocol: JSON lines. The first line on stdin is ``{"model": path, "threads": n, "n_ctx": n}``
(the model is loaded once); every further line is ``{"prompts": [[ids]], "max_tokens": n}`` and is
answered with one line ``{"outputs": [[ids]], "decode_s": [s], "total_s": [s]}``: greedy tokens,
eos ignored, each prompt alone (batch 1) from an empty KV cache. ``decode_s`` runs from the first
sampled token to the last, the same span our side times. No pickle: token ids only.

A job with ``"batched": true`` (and ``"max_tokens"`` a number or one per prompt, ``"n_batch"``,
``"flash_attn"``) runs every prompt at once through llama.cpp's C API, the way its server's
``--parallel`` does: one context with one unified KV cache holding all the sequences, prompts
prefilled in steps of up to ``n_batch`` tokens, then one step per token carrying every unfinished
sequence's next token; ``total_s`` is one wall time for all of it.
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


def _generate_batched(llm, job: dict, threads: int) -> tuple[list[list[int]], float]:
    import ctypes

    import llama_cpp
    import numpy as np

    prompts = job["prompts"]
    limits = job["max_tokens"]
    limits = [limits] * len(prompts) if isinstance(limits, int) else list(limits)
    n_batch = int(job.get("n_batch", 512))
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sum(len(p) + n for p, n in zip(prompts, limits, strict=True)) + 256
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = len(prompts)
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if job.get("flash_attn")
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    model = llm._model.model
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context for {len(prompts)} sequences")
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    try:

        def run(items):  # items: (token, seq, pos, wants_logits); returns the batch rows that asked
            rows = []
            for start in range(0, len(items), n_batch):
                part = items[start : start + n_batch]
                for i, (tok, seq, pos, want) in enumerate(part):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, int(want)
                batch.n_tokens = len(part)
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for i, (_, seq, _, want) in enumerate(part):
                    if want:  # read now: the next decode overwrites the logits
                        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
                        logits = np.ctypeslib.as_array(
                            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,)
                        )
                        rows.append((seq, int(logits.argmax())))
            return rows

        start = time.perf_counter()
        outs: list[list[int]] = [[] for _ in prompts]
        prefill = [(t, s, j, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        pending = run(prefill)
        while pending:
            step = []
            for seq, tok in pending:
                outs[seq].append(tok)
                if len(outs[seq]) < limits[seq]:
                    step.append((tok, seq, len(prompts[seq]) + len(outs[seq]) - 1, True))
            pending = run(step) if step else []
        return outs, time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def _without_repacking(llama_cpp) -> None:
    """llama.cpp's ``--no-repack``: no extra weight buffer types. On a CPU with AMX, 0.3.36's AMX
    buffers crash its prompt steps (a segfault in ``ggml_backend_amx_mul_mat`` on any batch of
    more than one token), so a user there has to run it this way."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params


def main() -> None:
    import llama_cpp

    setup = json.loads(sys.stdin.readline())
    if not setup.get("repack", True):
        _without_repacking(llama_cpp)
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
        if job.get("batched"):
            outs, total_s = _generate_batched(llm, job, setup["threads"])
            print(json.dumps({"outputs": outs, "total_s": [total_s]}), flush=True)
            continue
        outs, decode, total = [], [], []
        for prompt in job["prompts"]:
            o, d, t = _generate(llm, prompt, job["max_tokens"])
            outs.append(o)
            decode.append(d)
            total.append(t)
        print(json.dumps({"outputs": outs, "decode_s": decode, "total_s": total}), flush=True)


if __name__ == "__main__":
    main()
