"""Build the built-in default model: a locally trained tokenizer and a random-weight Llama.

    python -m engine_svc.models.build_default --out models/default

Deterministic: the same Python version gives the same bytes (tests/test_default_model.py checks).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from engine_svc.models.build import build_random_model
from tokenizer_svc.train import save_tokenizer, train_tokenizer

DEFAULT_SHAPE = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    initializer_range=0.05,
)
FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]


def build_default_model(out_dir: str | Path, vocab_size: int = 8192, seed: int = 0) -> Path:
    out = Path(out_dir)
    tok = train_tokenizer(vocab_size)
    save_tokenizer(tok, out, model_max_length=DEFAULT_SHAPE["max_position_embeddings"])
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    build_random_model(
        out,
        "llama",
        seed=seed,
        vocab_size=tok.get_vocab_size(),
        generation_eos=eos,
        **{**DEFAULT_SHAPE, "eos_token_id": eos[0]},
    )
    (out / "SHA256SUMS").write_text("".join(f"{digest(out / f)}  {f}\n" for f in FILES))
    return out


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="models/default")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build_default_model(args.out, args.vocab_size)
    print(f"built the default model in {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
