"""A tensor-parallel worker (ranks 1..N-1): holds its shard of the model and KV cache and mirrors
rank 0's forward pass for every step it receives, until told to stop or its parent dies.

Each step arrives as the scheduler's output (``SchedulerOutput``, plain data), the form rank 0's
runner reads too: the worker's own ``ModelRunner`` follows it (``ModelRunner.follow``), keeping its
record of each sequence by seq id and building the same forward inputs as rank 0."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from engine_svc.config import EngineConfig
from engine_svc.lora.adapter import LoRAAdapter
from engine_svc.lora.batch import LoRABatch
from engine_svc.lora.geometry import TARGET_MODULES, targets
from engine_svc.lora.manager import make_slots
from engine_svc.model_runner import ModelRunner
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.group import CMD_LORA_LOAD, CMD_STOP, HEADER_LEN, STEP_TIMEOUT, backend_for
from engine_svc.rank_runtime import RankRuntime
from engine_svc.scheduler_output import SchedulerOutput


def _exit_with_parent() -> None:
    # A blocked broadcast cannot notice that rank 0 is gone; this thread can.
    parent = os.getppid()
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--torch-threads", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig(**json.loads(args.config))
    if config.tensor_parallel_size != args.world_size:  # the shard is the config's
        raise ValueError(
            f"--world-size {args.world_size} against tensor_parallel_size {config.tensor_parallel_size}"
        )
    runtime = RankRuntime(config, args.rank)  # as rank 0 builds its own (engine.py)
    spec, device, kernels = runtime.spec, runtime.device, runtime.kernels
    dtype = runtime.activation_dtype  # the KV cache and LoRA hold what flows between the ops
    runtime.allocate_kv_caches(args.num_blocks)
    slots = None
    if config.enable_lora:
        slots = make_slots(spec, config.max_loras, config.max_lora_rank, dtype, device, runtime.shard)
        runtime.wrap_lora()
    mirror = SlotMirror(slots, kernels.lora_apply, device) if slots is not None else None
    # Block tables widen as sequences grow: the batch needs no model length up front.
    runner = ModelRunner(runtime.forward(), config.block_size, 1, lora=mirror)
    dist.init_process_group(
        backend_for(device),
        init_method=args.init_method,
        rank=args.rank,
        world_size=args.world_size,
        timeout=STEP_TIMEOUT,
    )
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    while True:
        dist.broadcast(header, src=0)
        head = header.tolist()
        if head[0] == CMD_STOP:
            break
        if head[0] == CMD_LORA_LOAD:
            _load_adapter(slots, spec, head, dtype, device)
            continue
        payload = torch.empty(head[1], dtype=torch.int64, device=device)
        dist.broadcast(payload, src=0)
        runner.follow(SchedulerOutput.from_wire(payload.cpu().numpy()))
    dist.destroy_process_group()


class SlotMirror:
    """A worker's view of rank 0's adapter slots: each slot holds the adapter version rank 0 loaded
    into it (``_load_adapter``), so a step's versions give its token slots as rank 0's do."""

    def __init__(self, slots, kernel, device):
        self.slots, self.kernel, self.device = slots, kernel, device

    @property
    def adapters(self) -> bool:
        return any(key is not None for key in self.slots.holder)

    def batch_versions(self, versions: list[int], num_new, in_use) -> LoRABatch | None:
        if not any(versions):
            return None
        slot_of = {key[1]: slot for slot, key in enumerate(self.slots.holder) if key is not None}
        seq_slots = np.array([slot_of[v] if v else -1 for v in versions], np.int64)
        token_slots = seq_slots if num_new is None else np.repeat(seq_slots, num_new)
        ranks = {slot_of[v]: self.slots.ranks[slot_of[v]] for v in set(versions) if v}
        return LoRABatch(self.slots, token_slots, ranks, self.kernel, self.device)


def _load_adapter(slots, spec: ModelSpec, head: list[int], dtype, device) -> None:
    """Receive what ``TensorParallelGroup.send_lora_load`` sends and load this rank's part."""
    _, slot, rank, num_pairs, version = head[:5]
    index = torch.empty(2 * num_pairs, dtype=torch.int64, device=device)
    if num_pairs:
        dist.broadcast(index, src=0)
    geometry = targets(spec)  # whole shapes: the sender's tensors are whole
    weights = {}
    pairs = index.view(-1, 2).tolist()
    for layer, m in pairs:
        t = geometry[TARGET_MODULES[m]]
        a = torch.empty(rank, t.in_features, dtype=dtype, device=device)
        b = torch.empty(t.out_features, rank, dtype=dtype, device=device)
        dist.broadcast(a, src=0)
        dist.broadcast(b, src=0)
        weights[(layer, TARGET_MODULES[m])] = (a, b)
    modules = frozenset(TARGET_MODULES[m] for _, m in pairs)
    slots.load_into(slot, LoRAAdapter(f"slot{slot}", "", rank, 1.0, modules, weights, version=version))


if __name__ == "__main__":
    main()
