"""Start the engine process: load the model, warm it up, serve engine.v1 and grpc.health.v1 until SIGTERM.

    python -m engine_svc.server --model DIR [--socket PATH | --host H --port P] [engine options]

It listens only once the model is loaded and one request has run end to end, so a gateway that
can connect knows the engine is warm. Health ("" and engine.v1.Engine) is SERVING from then on,
NOT_SERVING while the watchdog finds the loop stuck and once shutdown begins.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from engine_svc.model_card import model_card
from engine_svc.rpc.defaults import ENGINE_TCP_PORT
from engine_svc.rpc.engine_options import add_engine_options
from engine_svc.rpc.grpc_options import Keepalive, message_size_options
from engine_svc.rpc.log_setup import setup_logging
from engine_svc.rpc.shm_segments import sweep_stale_segments
from engine_svc.rpc.socket_dir import remove_if_owner_gone
from engine_svc.rpc.tls import add_port, server_tls_from_args
from engine_svc.server.cpus import torch_threads
from engine_svc.server.engine_loop import EngineLoop
from engine_svc.server.fault_injection import install_from_env
from engine_svc.server.health import EngineHealth
from engine_svc.server.malloc_tuning import fix_mmap_threshold
from engine_svc.server.servicer import EngineServicer
from llmserve_proto.engine.v1 import engine_pb2 as pb
from llmserve_proto.engine.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger("engine_svc.server")
MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_WATCHDOG_S = 30.0


def default_socket_path() -> str:
    # A per-user 0700 directory: other local users can neither connect nor squat on the name.
    d = Path(tempfile.gettempdir()) / f"llmserve-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return str(d / "engine.sock")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine_svc.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory (config.json, weights, tokenizer)")
    p.add_argument("--socket", help="unix socket path (the default, in a private per-user directory)")
    p.add_argument("--host", help="listen on TCP instead (an engine on another host); e.g. 127.0.0.1")
    p.add_argument("--port", type=int, default=ENGINE_TCP_PORT)
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    p.add_argument("--parent-pid", type=int, help="exit when this process (the launcher) is gone")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument(
        "--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, help="largest gRPC message in or out"
    )
    t = p.add_argument_group("TLS for a TCP listener (a gateway on another host)")
    t.add_argument("--tls-cert", help="server certificate (PEM)")
    t.add_argument("--tls-key", help="server private key (PEM)")
    t.add_argument("--tls-client-ca", help="require gateway client certificates signed by this CA (mTLS)")
    t.add_argument(
        "--health-port",
        type=int,
        help="also serve grpc.health.v1 alone, in plaintext, on this TCP port of the same host: for "
        "probes that cannot do TLS (Kubernetes' grpc probe) when the engine port has it",
    )
    add_engine_options(p)
    return p


def engine_config_kwargs(args) -> dict:
    kw = {"model": args.model, "enable_prefix_caching": not args.no_prefix_caching}
    for name in (
        "load_format",
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory",
        "max_num_seqs",
        "max_seqs_per_step",
        "max_num_batched_tokens",
        "attention_work_ratio",
        "decode_stall_factor",
        "max_model_len",
        "dtype",
        "kv_cache_dtype",
        "attention_dtype",
        "linear_dtype",
        "device",
        "seed",
        "scheduling_policy",
        "quantization",
        "quantized_activations",
        "max_loras",
        "max_lora_rank",
        "kv_offload_bytes",
        "kv_disk_dir",
    ):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    # The server keeps a disk tier by default: None is its default size (kv_tiers/setup.py; the
    # library's default is off: EngineConfig); --kv-disk-bytes 0 turns it off.
    kw["kv_disk_bytes"] = args.kv_disk_bytes
    if args.speculative_config:
        try:
            kw["speculative_config"] = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if args.enable_lora:
        kw["enable_lora"] = True
    if args.lora_modules:
        kw["lora_modules"] = parse_lora_modules(args.lora_modules)
    return kw


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``name=path`` pairs of ``--lora-modules``."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path pairs, got {item!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def listen_address(args) -> str:
    if args.host:
        return f"{args.host}:{args.port}"
    path = args.socket or default_socket_path()
    if os.path.exists(path):
        os.unlink(path)  # a leftover of a dead engine; a live one would hold the name in use
    return f"unix://{os.path.abspath(path)}"


def warm_up(engine) -> None:
    """Run one short request end to end so that the first client does not pay for lazy setup."""
    from engine_svc.sampling_params import SamplingParams

    engine.add_request("warmup", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def engine_info(engine) -> pb.EngineInfo:
    mi = engine.model_info
    card = model_card(engine.config.model)
    return pb.EngineInfo(
        model_name=mi.model_name,
        vocab_size=mi.vocab_size,
        max_model_len=mi.max_model_len,
        eos_token_ids=list(mi.eos_token_ids),
        block_size=mi.block_size,
        num_kv_blocks=mi.num_kv_blocks,
        max_logprobs=mi.max_logprobs,
        max_loras=engine.config.max_loras if engine.config.enable_lora else 0,
        max_lora_rank=engine.config.max_lora_rank if engine.config.enable_lora else 0,
        model_format=card.format,
        model_family=card.family,
        parameter_count=card.parameter_count,
        parameter_size=card.parameter_size,
        quantization_level=card.quantization_level,
        model_size_bytes=card.size_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format, "engine")
    try:
        tls = server_tls_from_args(args.tls_cert, args.tls_key, args.tls_client_ca)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fix_mmap_threshold()
    swept = sweep_stale_segments()
    if swept:
        log.info("removed %d stale shared-memory segment(s)", len(swept))

    try:
        threads = torch_threads(args.torch_threads)
    except ValueError as e:
        log.error("%s", e)
        return 2
    import torch  # torch loads here, after the signals are set

    from engine_svc import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(EngineConfig(**engine_config_kwargs(args)))
    except ValueError as e:  # a bad option: say which, exit 2 (as for the other flags)
        log.error("%s", e)
        return 2
    warm_up(engine)
    install_from_env(engine)  # faults on purpose, for the fault suite only (environment variables)
    info = engine_info(engine)
    watchdog_s = DEFAULT_WATCHDOG_S if args.watchdog_timeout is None else args.watchdog_timeout
    loop = EngineLoop(
        engine, heartbeat_s=args.heartbeat_s, parent_pid=args.parent_pid, watchdog_timeout_s=watchdog_s
    )
    loop.on_parent_exit = stop.set
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="engine-rpc"),
        options=[
            *message_size_options(args.max_message_bytes),
            *Keepalive().server_options(),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_EngineServicer_to_server(EngineServicer(loop, info), server)
    health = EngineHealth()
    health.add_to(server)
    loop.on_stall_change = lambda stalled: health.set_serving(not stalled)
    address = listen_address(args)
    if add_port(server, address, tls) == 0 and not address.startswith("unix:"):
        log.error("cannot listen on %s", address)
        return 1
    health_server = None
    if args.health_port is not None:
        # Status only, no engine.v1: nothing on it needs the link's credentials.
        health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health"))
        health.add_to(health_server)
        health_address = f"{args.host or '127.0.0.1'}:{args.health_port}"
        if health_server.add_insecure_port(health_address) == 0:
            log.error("cannot listen on %s for health", health_address)
            return 1
    loop.start()
    loop.call(lambda: None)  # the loop runs: it took a command between two (idle) steps
    health.set_serving(True)
    server.start()
    if health_server is not None:
        health_server.start()
        log.info("health (plaintext, grpc.health.v1 only) on %s", health_address)
    log.info(
        "engine ready on %s (model %s, %d KV blocks, %.1fs, torch threads %d, TLS %s, watchdog %s)",
        address,
        info.model_name,
        info.num_kv_blocks,
        time.perf_counter() - t0,
        torch.get_num_threads(),
        "off" if tls is None else ("mTLS" if tls.client_ca else "on"),
        f"{watchdog_s:g}s" if watchdog_s > 0 else "off",
    )
    while not stop.wait(0.5):
        if loop.stopped.is_set():
            log.error("the engine loop stopped; exiting")
            break
    crashed = not stop.is_set()
    log.info("shutting down")
    health.shutting_down()  # probes and watchers see NOT_SERVING while the loop and server stop
    loop.stop()
    server.stop(grace=1.0).wait(2.0)
    if health_server is not None:
        health_server.stop(grace=0.5).wait(1.0)
    if address.startswith("unix://"):
        socket_path = Path(address[len("unix://") :])
        socket_path.unlink(missing_ok=True)
        # A launcher killed by SIGKILL could not remove its private directory: do it for it.
        remove_if_owner_gone(socket_path.parent)
    return 1 if crashed else 0
