"""A tokenizer worker process: loads one model's tokenizer and answers framed protobuf requests.

Started by ``TokenizerPool`` as ``python -m tokenizer_svc.worker --model DIR``; requests arrive on
stdin and responses leave on stdout (see proto/tokenizer/v1/tokenizer.proto). The process ends
when stdin closes. Anything a library prints goes to stderr: the protocol keeps stdout to itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import BinaryIO

from llmserve_proto.tokenizer.v1 import tokenizer_pb2 as pb
from tokenizer_svc.chat_messages import from_proto
from tokenizer_svc.framing import frame, read_frame
from tokenizer_svc.tokenizer import Tokenizer, load_tokenizer


def handle(tok: Tokenizer, request: pb.WorkerRequest) -> pb.WorkerResponse:
    response = pb.WorkerResponse(request_id=request.request_id)
    try:
        kind = request.WhichOneof("kind")
        if kind == "encode":
            e = request.encode
            ids = tok.encode(
                e.text, add_special_tokens=e.add_special_tokens, parse_special_tokens=e.parse_special_tokens
            )
            response.token_ids.ids.extend(ids)
        elif kind == "chat":
            messages, tools = from_proto(request.chat)
            think = request.chat.enable_thinking if request.chat.HasField("enable_thinking") else None
            ids = tok.apply_chat_template(
                messages,
                add_generation_prompt=request.chat.add_generation_prompt,
                tools=tools,
                enable_thinking=think,
            )
            response.token_ids.ids.extend(ids)
        elif kind == "decode":
            response.text = tok.decode(
                request.decode.token_ids, skip_special_tokens=request.decode.skip_special_tokens
            )
        else:
            raise ValueError(f"unknown request kind {kind!r}")
    except ValueError as exc:
        response.error.kind = pb.WorkerError.INVALID_ARGUMENT
        response.error.message = str(exc)
    except Exception as exc:  # any other failure becomes an answer too: the worker stays up
        response.error.kind = pb.WorkerError.INTERNAL
        response.error.message = f"{type(exc).__name__}: {exc}"
    return response


def serve(model_dir: str, requests: BinaryIO, responses: BinaryIO, chat_template: str | None = None) -> None:
    tok = load_tokenizer(model_dir, chat_template)
    ready = pb.WorkerResponse(ready=pb.WorkerReady(pid=os.getpid(), vocab_size=tok.vocab_size))
    responses.write(frame(ready.SerializeToString()))
    responses.flush()
    while (payload := read_frame(requests)) is not None:
        response = handle(tok, pb.WorkerRequest.FromString(payload))
        responses.write(frame(response.SerializeToString()))
        responses.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder with tokenizer.json")
    parser.add_argument("--chat-template", help="a Jinja file that replaces the model's chat template")
    args = parser.parse_args(argv)
    # Keep the real stdout for frames and point fd 1 at stderr, so a stray print cannot corrupt them.
    responses = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve(args.model, sys.stdin.buffer, responses, args.chat_template)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        pass  # the pool went away; nobody is left to answer
    return 0


if __name__ == "__main__":
    sys.exit(main())
