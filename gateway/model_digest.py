"""The served model's digest, as Ollama's ``/api/tags`` and ``/api/ps`` list it: the sha256 of the
model's GGUF file (for an HF folder, of a manifest of its files, one ``<sha256>  <name>`` line each,
sorted by name). It is worked out once per server, in a thread started when the gateway starts (a
gigabyte takes seconds; no request ever hashes the file), and every caller awaits that one result. A
file the model catalogue placed (its name and size are a catalogue entry's) takes the entry's pinned
sha256, which the catalogue checked when it placed the file, without reading it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from engine_svc.models.catalogue import ENTRIES
from engine_svc.models.model_path import resolve_model_path

log = logging.getLogger("gateway.digest")
CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def pinned(path: Path) -> str | None:
    """The catalogue's sha256 for a file with one of its entries' name and size."""
    size = path.stat().st_size
    for e in ENTRIES:
        if e.file == path.name and e.size == size:
            return e.sha256
    return None


def model_digest(model: str | Path) -> str:
    """The digest of the model at ``model`` (a GGUF file, a folder holding one, or an HF folder)."""
    where = resolve_model_path(model)
    if where.gguf is not None:
        return pinned(where.gguf) or sha256_of(where.gguf)
    files = sorted(p for p in where.root.iterdir() if p.is_file())
    manifest = "".join(f"{sha256_of(p)}  {p.name}\n" for p in files)
    return hashlib.sha256(manifest.encode()).hexdigest()


class ModelDigest:
    """The digest, worked out once in a background thread; ``await get()`` for it ("" if the files
    could not be read: the routes still answer, and the log says why)."""

    def __init__(self, model: str | Path) -> None:
        self._future: Future[str] = Future()
        threading.Thread(target=self._work, args=(model,), name="model-digest", daemon=True).start()

    def _work(self, model) -> None:
        try:
            self._future.set_result(model_digest(model))
        except (OSError, ValueError) as e:
            log.warning("no digest for the model at %s: %s", model, e)
            self._future.set_result("")

    async def get(self) -> str:
        return await asyncio.wrap_future(self._future)
