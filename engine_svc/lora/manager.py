"""The engine's adapters: the registry in host memory (load, unload, list), the device slots, and
each step's token-to-slot mapping. Engine-side only: token ids and adapter names, never text."""

from __future__ import annotations

import itertools
import logging
import weakref

import numpy as np
import torch

from engine_svc.lora.adapter import AdapterError, LoRAAdapter, read_adapter
from engine_svc.lora.batch import LoRABatch
from engine_svc.lora.geometry import targets
from engine_svc.lora.slots import AdapterSlots
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard

log = logging.getLogger(__name__)
MAX_NAME_LEN = 256


class AdapterNotFound(LookupError):
    """A request or an unload named an adapter that is not loaded."""


class AdapterInUse(AdapterError):
    """An unload of an adapter that live requests use."""


class LoRAManager:
    def __init__(
        self,
        spec: ModelSpec,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel,
        shard: Shard | None = None,
    ):
        self.spec, self.max_loras, self.max_rank = spec, max_loras, max_rank
        self.dtype, self.device, self.kernel = dtype, device, kernel
        self.adapters: dict[str, LoRAAdapter] = {}
        # version -> adapter, while anything holds it (a request keeps its version alive after a
        # reload or an unload): what a step's sequences name their adapter by.
        self.by_version: weakref.WeakValueDictionary[int, LoRAAdapter] = weakref.WeakValueDictionary()
        # Host adapters are whole; the slots hold this rank's part (all of it without TP).
        self.slots = make_slots(spec, max_loras, max_rank, dtype, device, shard)
        self._versions = itertools.count(1)

    # --- registry -----------------------------------------------------------------------------
    def load(self, name: str, path: str, int_id: int | None = None) -> LoRAAdapter:
        """Read and check an adapter, then install it; ``AdapterError`` (a ValueError naming the
        problem) changes nothing."""
        return self.install(self.read(name, path, int_id))

    def read(self, name: str, path: str, int_id: int | None = None) -> LoRAAdapter:
        """The file work, touching no state: a server does it off the engine loop."""
        check_name(name)
        adapter = read_adapter(name, path, self.spec, self.max_rank, self.dtype)
        adapter.int_id = int_id
        return adapter

    def install(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Loading a name again replaces it: a new version, so the prefix cache keeps the two apart;
        live requests finish on the version they started with."""
        name, path = adapter.name, adapter.path
        adapter.version = next(self._versions)
        self.adapters[name] = adapter
        self.by_version[adapter.version] = adapter
        log.info(
            "LoRA adapter %r loaded from %s: rank %d, %d modules (%s), version %d",
            name,
            path,
            adapter.rank,
            len(adapter.weights),
            ",".join(sorted(adapter.modules)),
            adapter.version,
        )
        return adapter

    def unload(self, name: str) -> None:
        self.get(name)
        del self.adapters[name]
        self.slots.evict(name)
        log.info("LoRA adapter %r unloaded", name)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    # --- a step -------------------------------------------------------------------------------
    def batch(self, adapters: list[LoRAAdapter | None], num_new, in_use: set[tuple[str, int]]):
        """The step's ``LoRABatch`` for sequences using ``adapters`` (None = base), computing
        ``num_new`` tokens each; None when no token uses an adapter (a base step costs nothing)."""
        wanted = [a for a in adapters if a is not None]
        if not wanted:
            return None
        slot_of = self.slots.activate(wanted, in_use)
        seq_slots = np.array([-1 if a is None else slot_of[(a.name, a.version)] for a in adapters], np.int64)
        token_slots = seq_slots if num_new is None else np.repeat(seq_slots, num_new)
        ranks = {slot_of[(a.name, a.version)]: a.rank for a in wanted}
        return LoRABatch(self.slots, token_slots, ranks, self.kernel, self.device)

    def batch_versions(self, versions: list[int], num_new, in_use: set[tuple[str, int]]):
        """``batch`` for sequences naming their adapters by version (0: the base model), as the
        step's output does."""
        by_version = self.by_version
        return self.batch([by_version[v] if v else None for v in versions], num_new, in_use)


def make_slots(spec, max_loras, max_rank, dtype, device, shard: Shard | None = None) -> AdapterSlots:
    shard = shard or Shard()
    geometry = targets(spec, shard)
    return AdapterSlots(max_loras, max_rank, spec.num_layers, geometry, dtype, device, spec, shard)


def check_name(name) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or not name.isprintable():
        raise AdapterError(f"adapter name must be 1-{MAX_NAME_LEN} printable characters, got {name!r}")
