"""KV memory of one long sequence on a model with sliding-window layers (Gemma 3 270M by default):
the pages it holds once its window layers release what their window passed (KV cache groups,
``engine_svc/kv_groups.py``), against the one-table cache, where every layer kept a block for
every block of the sequence (``cdiv(tokens, block_size)`` blocks of all layers: what the engine
held before, measured on it at 257 x 18 = 4,626 layer-blocks for 4,104 tokens). Prints the ratio,
which is also the ratio of concurrent such sequences in a fixed KV budget at steady decode; and
the sizing bound's ratio (``KVLayout.blocks_per_seq``: room for a prefill chunk beside the window).

    python -m benchmarks.kv_window_memory [--model PATH] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import random

from engine_svc import EngineConfig, SamplingParams
from engine_svc.engine import LLMEngine

DEFAULT_MODEL = "models/gemma3-270m/gemma-3-270m-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    bs = args.block_size
    config = EngineConfig(
        model=args.model,
        block_size=bs,
        max_model_len=args.tokens + args.new + bs,
        enable_prefix_caching=False,
        num_kv_blocks=4 * (args.tokens // bs + 64),
        max_num_batched_tokens=args.chunk,
    )
    engine = LLMEngine(config)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, engine.spec.vocab_size) for _ in range(args.tokens)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True))
    peak = last = 0
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.stats().kv_blocks_used
        peak, last = max(peak, used), used or last
    layout, layers = engine.kv_layout, engine.spec.num_layers
    total = args.tokens + args.new
    one_table = -(-total // bs) * layers  # layer-blocks
    bound = layout.blocks_per_seq(total, bs, args.chunk) * layout.slots
    out = {
        "tokens": total,
        "layers": layers,
        "layers_per_page": layout.slots,
        "groups": [(g.window, len(g.layers)) for g in layout.groups],
        "pages_held": last,
        "pages_peak": peak,
        "layer_blocks_held": last * layout.slots,
        "layer_blocks_one_table": one_table,
        "ratio": one_table / (last * layout.slots),
        "ratio_at_peak": one_table / (peak * layout.slots),
        "ratio_sizing_bound": one_table / bound,
        "window_blocks_released": engine.kv.num_window_released,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
