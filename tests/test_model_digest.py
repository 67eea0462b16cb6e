"""The model digest Ollama's /api/tags and /api/ps list (gateway/model_digest.py): the GGUF file's
sha256 (checked against hashlib reading the file here), worked out once whatever the callers, a
catalogue file's pinned sha256 taken without reading the file, an HF folder's a manifest's."""

from __future__ import annotations

import asyncio
import hashlib

import gateway.model_digest as md
from engine_svc.models.catalogue import ENTRIES


def _file(path, data: bytes):
    path.write_bytes(data)
    return path


def test_a_gguf_file_or_its_folder_gives_the_files_sha256_once(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 9000  # more than one read's chunk
    gguf = _file(tmp_path / "m.gguf", data)
    want = hashlib.sha256(data).hexdigest()
    assert md.model_digest(gguf) == md.model_digest(tmp_path) == want
    reads = []
    real = md.sha256_of
    monkeypatch.setattr(md, "sha256_of", lambda p: reads.append(p) or real(p))

    async def many():
        digest = md.ModelDigest(gguf)
        return await asyncio.gather(*(digest.get() for _ in range(5))), await digest.get()

    got, again = asyncio.run(many())
    assert got == [want] * 5 and again == want and reads == [gguf]


def test_a_catalogue_file_takes_its_pinned_sha256_without_a_read(tmp_path, monkeypatch):
    e = ENTRIES[0]
    f = tmp_path / e.file
    with open(f, "wb") as out:  # its name and size, not its bytes (a sparse file)
        out.truncate(e.size)
    monkeypatch.setattr(md, "sha256_of", lambda p: (_ for _ in ()).throw(AssertionError("read")))
    assert md.model_digest(f) == e.sha256
    other = tmp_path / "other"
    other.mkdir()
    with open(other / e.file, "wb") as out:  # the name with another size: hashed
        out.truncate(e.size - 1)
    monkeypatch.setattr(md, "sha256_of", lambda p: "h")
    assert md.model_digest(other / e.file) == "h"


def test_an_hf_folder_gives_a_manifest_of_its_files(tmp_path):
    _file(tmp_path / "config.json", b"{}")
    _file(tmp_path / "model.safetensors", b"weights")
    lines = "".join(
        f"{hashlib.sha256(b).hexdigest()}  {n}\n"
        for n, b in [("config.json", b"{}"), ("model.safetensors", b"weights")]
    )
    assert md.model_digest(tmp_path) == hashlib.sha256(lines.encode()).hexdigest()


def test_an_unreadable_model_gives_an_empty_digest(tmp_path):
    assert asyncio.run(md.ModelDigest(tmp_path / "missing").get()) == ""
