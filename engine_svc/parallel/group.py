"""Rank 0's side of tensor parallelism: start the worker processes, join the process group,
send every step's output, and stop the workers.

Workers are separate interpreters (``python -m engine_svc.parallel.worker``): their configuration
travels as JSON on the command line and each step as two int64 broadcasts, a header and the step's
``SchedulerOutput`` in its wire form (``to_wire``), the one form every rank reads, so nothing is
pickled. gloo serves CPU tensors, NCCL CUDA ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from engine_svc.config import EngineConfig
from engine_svc.lora.geometry import TARGET_MODULES
from engine_svc.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

STEP_TIMEOUT = timedelta(minutes=10)
# Every message starts with a header of HEADER_LEN int64: its command, then the command's fields.
HEADER_LEN = 8
CMD_STEP, CMD_STOP, CMD_LORA_LOAD = 1, 2, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, num_blocks: int, device: torch.device):
        self.size = config.tensor_parallel_size
        self.device = device
        init_method = f"tcp://127.0.0.1:{free_port()}"
        config_json = json.dumps(dataclasses.asdict(config))
        self.workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "engine_svc.parallel.worker",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(self.size),
                    "--init-method",
                    init_method,
                    "--num-blocks",
                    str(num_blocks),
                    "--config",
                    config_json,
                    # Each rank runs the same kernels on its shard: the same thread count as this
                    # one (which the engine process sets to leave a CPU to the gateway).
                    "--torch-threads",
                    str(torch.get_num_threads()),
                ]
            )
            for rank in range(1, self.size)
        ]
        try:
            dist.init_process_group(
                backend_for(device),
                init_method=init_method,
                rank=0,
                world_size=self.size,
                timeout=STEP_TIMEOUT,
            )
        except Exception:
            self._kill()
            raise
        log.info("tensor parallel: %d ranks (%s)", self.size, backend_for(device))

    def broadcast(self, out: SchedulerOutput) -> None:
        """The step's output to every worker: each builds its forward's inputs from it."""
        payload = out.to_wire()
        self._send([CMD_STEP, len(payload)] + [0] * (HEADER_LEN - 2), payload)

    def send_lora_load(self, slot: int, adapter) -> None:
        """Rank 0 put ``adapter`` in ``slot``: the workers do the same with their parts. Its whole
        tensors travel (each worker cuts its own part, as rank 0 does), in the model's dtype."""
        pairs = sorted(adapter.weights)
        index = [v for layer, module in pairs for v in (layer, TARGET_MODULES.index(module))]
        header = [CMD_LORA_LOAD, slot, adapter.rank, len(pairs), adapter.version, 0, 0, 0]
        self._send(header, np.array(index, dtype=np.int64))
        for pair in pairs:
            for tensor in adapter.weights[pair]:
                dist.broadcast(tensor.contiguous().to(self.device), src=0)

    def _send(self, header: list[int], payload: np.ndarray | None) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=self.device), src=0)
        if payload is not None and len(payload):
            dist.broadcast(torch.from_numpy(payload).to(self.device), src=0)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                self._send([CMD_STOP] + [0] * (HEADER_LEN - 1), None)
            finally:
                dist.destroy_process_group()
        for w in self.workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()

    def _kill(self) -> None:
        for w in self.workers:
            w.kill()
            w.wait()
