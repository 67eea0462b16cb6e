"""The baseline of the engine issue: HF transformers ``generate`` with static batching — batches in
arrival order, left-padded, each run to the batch's longest output — on the engine's own weights."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.common import Req

PAD_ID = 0


def load_hf_model(model: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    with (
        torch.inference_mode()
    ):  # the first calls of a process pay one-off costs: keep them out of the timing
        hf.generate(
            input_ids=torch.tensor([[5, 6, 7, 8]] * 2), max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID
        )
    return hf


@torch.inference_mode()
def run_static_batches(hf, reqs: list[Req], batch_size: int) -> dict:
    """Output tokens/s counting each request's own output length (what a user receives), not the
    padding up to the batch maximum that static batching computes and throws away."""
    useful = computed = 0
    t0 = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        longest = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, longest - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, longest - len(r.prompt) :] = 1
        max_new = max(r.output_len for r in batch)
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
        assert out.shape[1] == longest + max_new, "HF stopped early: ignore_eos was not honoured"
        useful += sum(r.output_len for r in batch)
        computed += len(batch) * max_new
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, output_tokens=useful, computed_tokens=computed, output_tok_s=useful / wall)
