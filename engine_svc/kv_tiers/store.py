"""The host and disk tiers of the prefix cache: an index and the bytes, each bounded in bytes.

The KV cache manager owns one ``TieredStore``. Blocks the pool evicts come here (``put``) once
the model runner has read their bytes out; a lookup (``get``) that misses the pool and finds a
block here hands back its entry for the runner to copy into a fresh pool block before the step
that reads it. Host memory is the upper tier; what it evicts goes to disk (unless the disk holds
it already); the disk evicts its least recently used files. A disk entry is read whole and checked
(``entry.decode``) each time it is used: a corrupt, truncated or foreign file is deleted, counted
in ``rejected`` and treated as a miss. The disk tier's files outlive the engine: a new engine
with the same fingerprint finds them at start.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engine_svc.kv_tiers.entry import BadEntry, TierEntry, decode, encode

log = logging.getLogger(__name__)

SUFFIX = ".kv"


@dataclass
class TierStats:
    """One tier's figures since the engine started (``bytes`` and ``entries``: held now)."""

    tier: str
    capacity_bytes: int
    bytes: int = 0
    entries: int = 0
    hits: int = 0  # blocks loaded back from this tier
    stored: int = 0  # blocks written into it
    evicted: int = 0  # blocks it dropped (the host tier's go to disk when the disk lacks them)
    rejected: int = 0  # entries found bad (checksum, truncation, fingerprint, tokens): skipped
    load_seconds: float = 0.0  # reading and checking the blocks it served


class HostTier:
    """Blocks in this process's memory, least recently used first."""

    def __init__(self, capacity: int):
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()
        self.stats = TierStats("host", capacity)

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def get(self, key: int, token_ids: tuple[int, ...]) -> TierEntry | None:
        entry = self.entries.get(key)
        if entry is None or entry.meta.token_ids != token_ids:
            return None
        self.entries.move_to_end(key)
        self.stats.hits += 1
        return entry

    def put(self, entry: TierEntry) -> list[TierEntry]:
        """Keep ``entry``; returns what the bound evicted (``entry`` itself if it never fits)."""
        st = self.stats
        if entry.nbytes > st.capacity_bytes:
            return [entry]
        key = entry.meta.key
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        self.entries[key] = entry
        st.bytes += entry.nbytes
        st.stored += 1
        out = []
        while st.bytes > st.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            st.bytes -= old.nbytes
            st.evicted += 1
            out.append(old)
        st.entries = len(self.entries)
        return out


class DiskTier:
    """One file per block under ``root/<fingerprint>/``, least recently used first (by the file's
    modification time across restarts)."""

    def __init__(self, root: str | Path, capacity: int, fingerprint: bytes):
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index: OrderedDict[int, int] = OrderedDict()  # key -> file size
        self.stats = TierStats("disk", capacity)
        self._scan()

    def _path(self, key: int) -> Path:
        name = f"{key:016x}"
        return self.dir / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous engine left (names only: each is checked when read)."""
        found = []
        for path in self.dir.glob(f"*/*{SUFFIX}"):
            try:
                key = int(path.stem, 16)
                st = path.stat()
            except (ValueError, OSError):
                continue
            if path != self._path(key):
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.stats.bytes += size
        self._evict()
        self.stats.entries = len(self.index)
        if found:
            log.info(
                "KV disk tier %s: %d blocks (%d MiB) from earlier runs",
                self.dir,
                len(self.index),
                self.stats.bytes >> 20,
            )

    def __contains__(self, key: int) -> bool:
        return key in self.index

    def get(self, key: int, token_ids: tuple[int, ...]) -> TierEntry | None:
        if key not in self.index:
            return None
        path = self._path(key)
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
            entry = decode(data, self.fingerprint, key, token_ids)
        except OSError:  # gone (another engine sharing the directory evicted it)
            self._forget(key)
            return None
        except BadEntry as e:
            log.warning("KV disk tier: skipping %s: %s", path, e)
            self.stats.rejected += 1
            self._forget(key, unlink=True)
            return None
        finally:
            self.stats.load_seconds += time.perf_counter() - started
        self.index.move_to_end(key)
        try:
            os.utime(path)  # its place in the LRU order, for the next engine
        except OSError:
            pass
        self.stats.hits += 1
        return entry

    def put(self, entry: TierEntry) -> None:
        key = entry.meta.key
        if key in self.index:
            self.index.move_to_end(key)
            return
        pieces = encode(entry, self.fingerprint)
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        if size > self.stats.capacity_bytes:
            return
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                for p in pieces:
                    f.write(p)
            os.replace(tmp, path)  # whole or absent: a reader never sees half a file
        except OSError as e:
            log.warning("KV disk tier: cannot write %s: %s", path, e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        self.index[key] = size
        self.stats.bytes += size
        self.stats.stored += 1
        self._evict()
        self.stats.entries = len(self.index)

    def bound(self, capacity: int) -> None:
        """A new bound (the default size, once the free space is known): the least recently used
        files past it go."""
        self.stats.capacity_bytes = capacity
        self._evict()
        self.stats.entries = len(self.index)

    def _evict(self) -> None:
        while self.stats.bytes > self.stats.capacity_bytes and self.index:
            key = next(iter(self.index))
            self._forget(key, unlink=True)
            self.stats.evicted += 1

    def _forget(self, key: int, unlink: bool = False) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.stats.bytes -= size
        self.stats.entries = len(self.index)
        if unlink:
            try:
                self._path(key).unlink()
            except OSError:
                pass


class TieredStore:
    """Host memory over disk; either may be absent (a capacity of 0)."""

    def __init__(self, host_bytes: int, disk_bytes: int, disk_dir: str | Path | None, fingerprint: bytes):
        self.fingerprint = fingerprint
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, fingerprint) if disk_bytes > 0 and disk_dir else None

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def __contains__(self, key: int) -> bool:
        return (self.host is not None and key in self.host) or (self.disk is not None and key in self.disk)

    def get(self, key: int, token_ids: tuple[int, ...]) -> TierEntry | None:
        """The entry for ``key`` holding ``token_ids``, checked, from the highest tier that has it."""
        if self.host is not None:
            entry = self.host.get(key, token_ids)
            if entry is not None:
                return entry
        return self.disk.get(key, token_ids) if self.disk is not None else None

    def put(self, entry: TierEntry) -> None:
        """A block the pool evicted: to host memory, whose overflow goes to disk."""
        spilled = [entry] if self.host is None else self.host.put(entry)
        if self.disk is not None:
            for old in spilled:
                self.disk.put(old)

    def clear_host(self) -> None:
        """Forget the host tier's blocks (a reset of the prefix cache; the disk tier's files stay)."""
        if self.host is not None:
            self.host.entries.clear()
            self.host.stats.bytes = self.host.stats.entries = 0

    def stats(self) -> list[TierStats]:
        return [t.stats for t in (self.host, self.disk) if t is not None]
