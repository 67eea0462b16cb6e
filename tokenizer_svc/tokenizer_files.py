"""Where a model's tokenizer files are: its own ``tokenizer.json``, or, for a GGUF file, one
converted from the file's metadata (vocabulary, merges, special tokens, chat template).

The conversion (transformers' GGUF tokenizer converter) takes seconds for a large vocabulary, and
every process that tokenizes (gateway, tokenizer workers, the engine's grammar compiler) needs it,
so it is done once per file and kept in a cache keyed by the file's path, size and modification
time; a changed file is converted again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from engine_svc.models.model_path import resolve_model_path
from tokenizer_svc.gguf_vocab import align

log = logging.getLogger(__name__)


def find_tokenizer_dir(model: str | Path) -> Path | None:
    """The directory with ``tokenizer.json`` for ``model`` (a tokenizer or model directory, or a
    GGUF file); None for a directory with neither (a token-only model)."""
    path = Path(model)
    if path.is_dir() and (path / "tokenizer.json").exists():
        return path
    if path.is_dir() and not any(path.glob("*.gguf")):
        return None
    where = resolve_model_path(path)
    if where.is_gguf:
        return gguf_tokenizer_dir(where.gguf)
    return where.root if (where.root / "tokenizer.json").exists() else None


def cache_root() -> Path:
    root = os.environ.get("LLMSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve"
    )
    return Path(root) / "gguf-tokenizers"


# Part of the cache key: a conversion written by an earlier version of the steps below is redone.
CONVERSION_VERSION = 2  # 2: aligned with the file's own tokenizer (tokenizer_svc/gguf_vocab.py)


def gguf_tokenizer_dir(gguf: Path) -> Path:
    st = gguf.stat()
    ident = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERSION_VERSION}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    out = cache_root() / key
    if (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes that start together (gateway, tokenizer workers, engine) wait for one conversion.
    with open(out.parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "tokenizer.json").exists():
            _convert(gguf, out)
    return out


def _vocab_metadata(gguf: Path) -> dict:
    """What ``gguf_vocab.align`` reads of the file's tokenizer metadata (the merge table skipped)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta, _ = read_gguf_metadata(str(gguf), string_arrays={"tokenizer.ggml.tokens"})
    return {
        "model": meta.get("tokenizer.ggml.model"),
        "pre": meta.get("tokenizer.ggml.pre"),
        "add_space_prefix": bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        "tokens": meta["tokenizer.ggml.tokens"],
        "token_type": list(meta.get("tokenizer.ggml.token_type", ())),
    }


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    start = time.perf_counter()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:
        # AutoTokenizer first reads the file's model config, which transformers' GGUF reader knows for
        # a fixed list of architectures (not SmolLM3's); the tokenizer metadata does not depend on
        # the architecture, and the generic backend converts it alone.
        from transformers import TokenizersBackend

        try:
            tok = TokenizersBackend.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception:
            raise ValueError(f"GGUF file {gguf.name}: its tokenizer metadata cannot be converted: {e}") from e
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tok.save_pretrained(str(tmp))
    # Reloaded under its model-specific class, transformers would rebuild the pre-tokenizer from that
    # class's defaults; the generic backend takes tokenizer.json as converted.
    config_path = tmp / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "TokenizersBackend"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    json_path = tmp / "tokenizer.json"
    converted = json.loads(json_path.read_text(encoding="utf-8"))
    changes = align(converted, _vocab_metadata(gguf))
    if changes:
        json_path.write_text(json.dumps(converted, ensure_ascii=False), encoding="utf-8")
        log.info("tokenizer of %s aligned with the model's own: %s", gguf.name, "; ".join(changes))
    try:
        tmp.rename(out)
    except OSError:  # another process's conversion got there first (no lock on this file system)
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tokenizer of %s converted in %.1fs (cached in %s)", gguf.name, time.perf_counter() - start, out)
