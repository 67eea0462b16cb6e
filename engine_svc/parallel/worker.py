"""A tensor-parallel worker (ranks 1..N-1): holds its shard of the model and KV cache and mirrors
rank 0's forward pass for every step it receives, until told to stop or its parent dies."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
import torch.distributed as dist

from engine_svc.config import EngineConfig
from engine_svc.engine import resolve_device, resolve_dtype, resolve_max_model_len
from engine_svc.model_runner import ModelForward
from engine_svc.model_setup import allocate_kv_caches, load_model
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.group import STEP_TIMEOUT, backend_for
from engine_svc.parallel.shard import Shard
from engine_svc.step_inputs import CMD_STOP, HEADER_LEN, StepInputs
from kernels.backend import select_kernels


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
    shard = Shard(args.rank, args.world_size)
    device = resolve_device(config.device, args.rank)
    dtype = resolve_dtype(config.dtype, device)
    spec = ModelSpec.from_dir(config.model)
    torch.manual_seed(config.seed)
    model = load_model(config, spec, dtype, device, resolve_max_model_len(spec, config), shard)
    kv_caches = allocate_kv_caches(spec, shard, args.num_blocks, config.block_size, dtype, device)
    forward = ModelForward(model, select_kernels(device, config.kernel_backend), kv_caches, device)
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
        payload = torch.empty(head[6], dtype=torch.int64, device=device)
        dist.broadcast(payload, src=0)
        forward(StepInputs.unpack(head, payload.cpu().numpy()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
