"""engine.v1.Engine over gRPC: thin handlers that post work to the engine loop."""

from __future__ import annotations

import logging
import queue

import grpc

from engine_svc.lora.manager import AdapterInUse, AdapterNotFound
from engine_svc.models import layer_progress
from engine_svc.rpc.convert import sampling_params_from_proto
from engine_svc.server.engine_loop import CallAbandoned, EngineLoop, Session
from engine_svc.server.kv_event_feed import FeedClosed, SubscriberDropped
from llmserve_proto.engine.v1 import engine_pb2 as pb
from llmserve_proto.engine.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger("engine_svc.server")
MAX_RING_BYTES = 1 << 30


class _Refused(Exception):
    """A Submit the engine refuses as invalid (INVALID_ARGUMENT)."""


class _InUse(Exception):
    """An unload of an adapter live requests use (FAILED_PRECONDITION)."""


def adapter_info(a) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=a.name, path=a.path, rank=a.rank, version=a.version, target_modules=sorted(a.modules)
    )


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, loop: EngineLoop, info: pb.EngineInfo) -> None:
        self._loop = loop
        self._info = info

    def GetInfo(self, request, context):
        return self._info

    def GetStats(self, request, context):
        return self._call(
            context, lambda: self._loop.stats(request.check_invariants, request.include_cached_block_hashes)
        )

    def StreamKvEvents(self, request: pb.KvEventsRequest, context):
        loop = self._loop
        sub = self._call(context, lambda: loop.subscribe_kv_events(request.max_buffered_batches))
        # However the stream ends, the subscriber goes (and with the last one, the events stop).
        context.add_callback(lambda: loop.post(lambda: loop.unsubscribe_kv_events(sub)))
        while context.is_active():
            try:
                batch = sub.next(timeout=loop.heartbeat_s)
            except SubscriberDropped as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except FeedClosed:
                return
            if batch is not None:
                yield batch

    def Connect(self, request: pb.ConnectRequest, context):
        if max(request.prompt_ring_bytes, request.output_ring_bytes) > MAX_RING_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"ring sizes are limited to {MAX_RING_BYTES} bytes"
            )
        s: Session = self._call(
            context,
            lambda: self._loop.open_session(
                request.gateway_id, request.prompt_ring_bytes, request.output_ring_bytes
            ),
        )
        # Whatever ends the stream (the gateway leaving, a shutdown), the session's requests are
        # aborted and its rings unlinked.
        context.add_callback(lambda: self._loop.post(lambda: self._loop.close_session(s.session_id)))
        connected = pb.Connected(session_id=s.session_id, info=self._info)
        if s.prompt_ring is not None:
            connected.rings.prompt_ring = s.prompt_ring.name
            connected.rings.output_ring = s.output_ring.name
        yield pb.EngineEvent(connected=connected)
        while context.is_active():
            try:
                event = s.outbox.get(timeout=self._loop.heartbeat_s)
            except queue.Empty:
                beat = pb.Heartbeat(
                    load=self._loop.load,
                    layers_run=layer_progress.value(),
                    starved=self._loop.watchdog.starved,
                )
                event = pb.EngineEvent(heartbeat=beat)
            if event is None:
                return
            yield event

    def Submit(self, request: pb.SubmitRequest, context):
        s = self._session(request.session_id, context)
        try:
            prompt, params = self._decode_submit(s, request)
            self._call(
                context,
                lambda: self._loop.add_request(
                    s,
                    request.request_id,
                    prompt,
                    params,
                    request.priority,
                    request.cache_salt or None,
                    request.lora or None,
                    request.client,
                ),
                refusal=True,
            )
        except _Refused as e:
            # The gateway validates first: a refusal here means something slipped past it (counted,
            # so that tests can prove the engine never saw an invalid request).
            self._loop.refused_submits += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.SubmitResponse()

    @staticmethod
    def _decode_submit(s: Session, request: pb.SubmitRequest):
        kind = request.WhichOneof("prompt")
        if kind == "prompt_span":
            if s.prompt_ring is None:
                raise _Refused("this session has no prompt ring")
            try:
                prompt = s.prompt_ring.read_and_release(request.prompt_span.start, request.prompt_span.length)
            except ValueError as e:
                raise _Refused(str(e)) from e
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise _Refused("prompt: token ids are required")
        try:
            params = sampling_params_from_proto(request.params)
        except (TypeError, ValueError) as e:
            raise _Refused(str(e)) from e
        return prompt, params

    def Abort(self, request: pb.AbortRequest, context):
        s = self._session(request.session_id, context)
        index = request.index if request.HasField("index") else None
        n = self._call(context, lambda: self._loop.abort(s, list(request.request_ids), index))
        return pb.AbortResponse(num_aborted=n)

    def SetPaused(self, request: pb.SetPausedRequest, context):
        s = self._session(request.session_id, context)
        n = self._call(context, lambda: self._loop.set_paused(s, list(request.request_ids), request.paused))
        return pb.SetPausedResponse(num_changed=n)

    # --- LoRA adapters ------------------------------------------------------------------------
    def LoadAdapter(self, request: pb.LoadAdapterRequest, context):
        engine = self._loop.engine
        try:
            adapter = engine.read_lora(request.name, request.path)  # the file work, off the loop
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return adapter_info(self._call(context, lambda: engine.install_lora(adapter)))

    def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context):
        try:
            self._call(context, lambda: self._loop.engine.remove_lora(request.name), in_use=True)
        except _InUse as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.UnloadAdapterResponse()

    def ListAdapters(self, request, context):
        engine = self._loop.engine
        adapters = self._call(context, engine.list_loras)
        on = engine.config.enable_lora
        return pb.ListAdaptersResponse(
            adapters=[adapter_info(a) for a in adapters],
            max_loras=engine.config.max_loras if on else 0,
            max_lora_rank=engine.config.max_lora_rank if on else 0,
        )

    def _session(self, session_id: str, context) -> Session:
        s = self._loop.session(session_id)  # a dict read; the loop only adds and removes whole entries
        if s is None or s.closed:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown or closed session {session_id!r}")
        return s

    def _call(self, context, fn, refusal: bool = False, in_use: bool = False):
        if self._loop.stalled.is_set():  # the loop would not answer until its stuck step returns
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is stalled (watchdog)")
        loop = self._loop

        def give_up() -> str | None:
            if loop.stalled.is_set():
                return "the engine is stalled (watchdog)"
            return None if context.is_active() else "the caller left"

        try:
            return loop.call(fn, give_up)
        except CallAbandoned as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except AdapterNotFound as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except AdapterInUse as e:
            if in_use:
                raise _InUse(str(e)) from e
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            if refusal:
                raise _Refused(str(e)) from e
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
