"""Bytes that are not the request message answer INVALID_ARGUMENT, not UNKNOWN.

gRPC parses a request before the handler runs, and a parse failure surfaces as UNKNOWN ("Unexpected
DecodeError"), which tells a client nothing useful and looks like a server fault. This interceptor
takes the parsing of unary requests into the handler, where a failure is the client's error.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method

        async def decoded(raw: bytes, context):
            try:
                return parse(raw)
            except (DecodeError, ValueError, TypeError):
                message = f"the request bytes are not a valid message for {method}"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(raw, context):
                request = await decoded(raw, context)
                async for msg in behavior(request, context):
                    yield msg

            async def unary_stream_writer(raw, context):  # a handler that sends with context.write()
                await behavior(await decoded(raw, context), context)

            wrapped = unary_stream if inspect.isasyncgenfunction(behavior) else unary_stream_writer
            return grpc.unary_stream_rpc_method_handler(
                wrapped, response_serializer=handler.response_serializer
            )
        behavior = handler.unary_unary

        async def unary_unary(raw, context):
            return await behavior(await decoded(raw, context), context)

        serialize = handler.response_serializer
        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)
