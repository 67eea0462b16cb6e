"""The one thread that touches the engine: drain commands, step, hand each session its deltas.

The engine is synchronous and single-threaded, so gRPC handler threads never call it: they post
a command (a closure) and wait for its result, and the loop runs commands only between two steps.
Each gateway is a session with an outbox; a step puts at most one message into each session's
outbox, holding all of that session's deltas (ids in its output ring when it has one).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from engine_svc.models import layer_progress
from engine_svc.rpc.convert import delta_to_proto
from engine_svc.rpc.shm_ring import TokenRing
from engine_svc.server.kv_event_feed import KvEventFeed, Subscriber
from engine_svc.server.throughput import ThroughputWindow
from engine_svc.server.watchdog import Watchdog, process_cpu
from llmserve_proto.engine.v1 import engine_pb2 as pb

log = logging.getLogger("engine_svc.server")
_CLOSED = None  # the sentinel that ends a session's stream


@dataclass
class Session:
    session_id: str
    gateway_id: str
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    prompt_ring: TokenRing | None = None
    output_ring: TokenRing | None = None
    # Client request ids the engine still holds. Which of a request's n outputs are running is the
    # engine's to know: it says so with ``request_finished``, and this set follows it.
    live: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)  # of ``live``: paused by the gateway (backpressure)
    load_sent_at: float = 0.0  # when the load figures it last got were refreshed
    closed: bool = False


class EngineLoop:
    def __init__(
        self, engine, heartbeat_s: float = 0.5, parent_pid: int | None = None, watchdog_timeout_s: float = 0.0
    ) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self._parent_pid = parent_pid
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[str, Session] = {}
        self._stopping = threading.Event()
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._step_counter = itertools.count(1)
        self.load = pb.Load()
        self._load_at = 0.0
        self._throughput = ThroughputWindow()
        self._rates = (0.0, 0.0)  # prompt, generation tokens/s: refreshed with the load
        self.kv_events = KvEventFeed()  # KV-cache event subscribers (routers); nothing while none
        self.on_parent_exit: Callable[[], None] | None = None
        # Set by the watchdog while a step has run past its timeout: no new sessions or requests.
        self.stalled = threading.Event()
        # Told True / False each time ``stalled`` changes (health turns NOT_SERVING / SERVING).
        self.on_stall_change: Callable[[bool], None] | None = None
        self._stall_report = threading.Lock()
        self.refused_submits = 0  # Submits refused as invalid (INVALID_ARGUMENT); a gRPC thread counts
        self.watchdog = Watchdog(
            watchdog_timeout_s,
            on_stall=self._on_stall,
            on_recover=self._on_recover,
            progress=layer_progress.value,
            cpu=process_cpu,
        )

    # Called from other threads -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self.watchdog.start()

    def call(self, fn: Callable, give_up: Callable[[], str | None] | None = None):
        """Run ``fn()`` on the loop thread between two steps and return (or raise) its result.

        No fixed deadline: a step may rightly take longer than any bound (a long prompt's chunk on
        a slow machine), and the watchdog, not a timer, tells a slow step from a hung one. The
        caller waits until ``give_up()`` names a reason to stop waiting (the watchdog tripped, the
        caller left): ``CallAbandoned`` with that reason. ``fn`` may still run afterwards."""
        if self._stopping.is_set():
            raise RuntimeError("the engine is shutting down")
        fut: Future = Future()
        self._commands.put((fn, fut))
        while True:
            try:
                return fut.result(timeout=None if give_up is None else self.heartbeat_s)
            except FutureTimeout:
                why = give_up()
                if why:
                    raise CallAbandoned(why) from None

    def post(self, fn: Callable) -> None:
        self._commands.put((fn, None))

    def stop(self, timeout: float = 10.0) -> None:
        self.watchdog.stop()
        self._stopping.set()
        self._commands.put((lambda: None, None))
        self._thread.join(timeout)

    def _on_stall(self, waited_s: float) -> None:
        """From the watchdog's thread while the loop is stuck: end every session's stream now, so
        that each gateway fails its open streams with UNAVAILABLE and stops sending work here. The
        sessions' requests are aborted (and rings unlinked) by the loop once it runs again."""
        self.stalled.set()
        for s in list(self._sessions.values()):
            if not s.closed:
                s.closed = True
                s.outbox.put(_CLOSED)
                self.post(lambda sid=s.session_id: self.close_session(sid))
        log.error("engine stalled for %.1fs: sessions ended; refusing work until a step completes", waited_s)
        if not self.watchdog.tripped:
            # The stuck step returned while this ran, and its recovery may have cleared the flag
            # before this set it: the loop is fine, so the flag must not stay set.
            self.stalled.clear()
        self._report_stall()

    def _on_recover(self) -> None:
        """From the loop thread: a step completed after the watchdog tripped."""
        self.stalled.clear()
        self._report_stall()

    def _report_stall(self) -> None:
        # Under one lock, and reading the flag rather than being told it, so that a stall and a
        # recovery reported at once from two threads leave the last report equal to the flag.
        with self._stall_report:
            if self.on_stall_change is not None:
                self.on_stall_change(self.stalled.is_set())

    # Commands (run on the loop thread) -----------------------------------------------------------

    def open_session(self, gateway_id: str, prompt_ring_bytes: int, output_ring_bytes: int) -> Session:
        s = Session(session_id=secrets.token_hex(8), gateway_id=gateway_id)
        if prompt_ring_bytes and output_ring_bytes:
            try:
                s.prompt_ring = TokenRing.create(prompt_ring_bytes)
                s.output_ring = TokenRing.create(output_ring_bytes)
            except OSError as e:  # no room in /dev/shm: the session still works, ids go inline
                if s.prompt_ring is not None:
                    s.prompt_ring.close()
                s.prompt_ring = s.output_ring = None
                log.warning(
                    "session %s: no shared-memory rings (%s); token ids go in gRPC messages", s.session_id, e
                )
        self._sessions[s.session_id] = s
        log.info(
            "session %s opened for gateway %r (shared memory: %s)",
            s.session_id,
            gateway_id,
            s.prompt_ring is not None,
        )
        return s

    def session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def close_session(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is None:
            return
        for rid in list(s.live):
            self.engine.abort_request(_engine_id(s, rid))
        s.live.clear()
        s.paused.clear()
        if not s.closed:
            s.closed = True
            s.outbox.put(_CLOSED)
        for ring in (s.prompt_ring, s.output_ring):
            if ring is not None:
                ring.close()
        log.info("session %s closed", session_id)

    def add_request(
        self,
        s: Session,
        request_id: str,
        prompt: list[int],
        params,
        priority: int,
        cache_salt: str | None,
        lora: str | None = None,
        client: str = "",
    ) -> None:
        if s.closed or self.stalled.is_set():
            raise RuntimeError("session closed" if s.closed else "the engine is stalled")
        self.engine.add_request(
            _engine_id(s, request_id),
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            lora=lora,
            client=_engine_id(s, client),  # one gateway's clients are not another's
        )
        s.live.add(request_id)

    def abort(self, s: Session, request_ids: list[str], index: int | None = None) -> int:
        n = 0
        for rid in request_ids:
            if rid not in s.live:
                continue
            eid = _engine_id(s, rid)
            n += bool(self.engine.abort_request(eid, index))
            if self.engine.request_finished(eid):
                s.live.discard(rid)
                s.paused.discard(rid)
        return n

    def set_paused(self, s: Session, request_ids: list[str], paused: bool) -> int:
        """Pause (or resume) requests of this session; returns how many were live here."""
        n = 0
        for rid in request_ids:
            if rid not in s.live:
                continue  # finished or aborted meanwhile: nothing to pause
            eid = _engine_id(s, rid)
            if self.engine.pause_request(eid) if paused else self.engine.resume_request(eid):
                n += 1
                if paused:
                    s.paused.add(rid)
                else:
                    s.paused.discard(rid)
        return n

    def subscribe_kv_events(self, max_batches: int) -> Subscriber:
        return self.kv_events.subscribe(self.engine, max_batches)

    def unsubscribe_kv_events(self, sub: Subscriber) -> None:
        self.kv_events.unsubscribe(self.engine, sub)

    def stats(self, check_invariants: bool, cached_block_hashes: bool = False) -> pb.EngineStats:
        st = self.engine.stats()
        out = pb.EngineStats(
            load=self._load_from(st),
            num_sessions=sum(not s.closed for s in self._sessions.values()),
            num_live_requests=sum(len(s.live) for s in self._sessions.values()),
            num_refused_submits=self.refused_submits,
        )
        if cached_block_hashes:
            out.cached_block_hashes.extend(sorted(self.engine.cached_block_hashes()))
        if check_invariants:
            try:
                self.engine.check_invariants()
            except AssertionError as e:
                out.invariant_error = str(e) or "invariant check failed"
        return out

    # The loop ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            nothing_to_run = False
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests() and not nothing_to_run
                nothing_to_run = False
                self._drain_commands(block_s=0.0 if busy else self.heartbeat_s)
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self.watchdog.step_started()
                    t0 = time.perf_counter()
                    steps_before = self.engine.num_steps
                    deltas = self.engine.step()
                    step_time = time.perf_counter() - t0
                    if (
                        self.engine.num_steps == steps_before
                        and not deltas
                        and not self.engine.compiling_grammars()
                    ):
                        # Nothing could run (every request paused by backpressure): wait for the
                        # next command (a resume, a new request, an abort) instead of spinning.
                        self.watchdog.idle()
                        nothing_to_run = True
                    else:
                        self.watchdog.step_finished(pending=self.engine.has_unfinished_requests())
                        self._route(deltas, step_time)
                else:
                    self.watchdog.idle()
                self.kv_events.publish(self.engine)  # this step's cache changes (and commands')
                self._refresh_load()
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    log.warning("parent process %d is gone; shutting down", self._parent_pid)
                    if self.on_parent_exit is not None:
                        self.on_parent_exit()
                    self._parent_pid = None
        except Exception:
            log.exception("engine loop failed")
            raise
        finally:
            for sid in list(self._sessions):
                self.close_session(sid)
            self.kv_events.close()
            self._fail_pending_commands()
            self.stopped.set()

    def _drain_commands(self, block_s: float) -> None:
        try:
            item = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            try:
                result = fn()
            except BaseException as e:  # the caller gets the error; the loop goes on
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.exception("engine command failed")
            else:
                if fut is not None:
                    fut.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError("the engine is shutting down"))

    def _route(self, deltas, step_time_s: float = 0.0) -> None:
        step = next(self._step_counter)
        per_session: dict[str, list] = {}
        for d in deltas:
            sid, _, rid = d.request_id.partition("/")
            s = self._sessions.get(sid)
            if s is None or s.closed or rid not in s.live:
                continue
            per_session.setdefault(sid, []).append((rid, d))
            if d.request_finished:
                s.live.discard(rid)
                s.paused.discard(rid)
        for sid, items in per_session.items():
            s = self._sessions[sid]
            out = pb.StepOutput(step=step, step_time_s=step_time_s)
            if s.load_sent_at < self._load_at:  # a busy engine sends no heartbeats: the load rides along
                out.load.CopyFrom(self.load)
                s.load_sent_at = self._load_at
            if s.output_ring is not None:
                ids = [t for _, d in items for t in d.new_token_ids]
                start = s.output_ring.try_write(ids)
                if start is not None:
                    out.in_ring = True
                    out.output_span.start = start
                    out.output_span.length = len(ids)
            out.deltas.extend(delta_to_proto(d, rid, inline_ids=not out.in_ring) for rid, d in items)
            s.outbox.put(pb.EngineEvent(step=out))

    def _refresh_load(self) -> None:
        now = time.monotonic()
        if now - self._load_at >= self.heartbeat_s / 2:
            st = self.engine.stats()
            self._rates = self._throughput.add(now, st.prompt_tokens_computed, st.generation_tokens)
            self.load = self._load_from(st)
            self._load_at = now

    def _load_from(self, st) -> pb.Load:
        return pb.Load(
            num_paused=sum(len(s.paused) for s in self._sessions.values()),
            num_running=st.num_running,
            num_waiting=st.num_waiting,
            kv_blocks_used=st.kv_blocks_used,
            kv_blocks_total=st.kv_blocks_total,
            num_steps=st.num_steps,
            prefix_queried_tokens=st.prefix_queried_tokens,
            prefix_hit_tokens=st.prefix_hit_tokens,
            num_preemptions=st.num_preemptions,
            spec_draft_tokens=st.num_draft_tokens,
            spec_accepted_tokens=st.num_accepted_draft_tokens,
            prompt_tokens_computed=st.prompt_tokens_computed,
            generation_tokens=st.generation_tokens,
            prompt_tokens_per_s=self._rates[0],
            generation_tokens_per_s=self._rates[1],
            running_lora_adapters=st.running_lora_adapters,
            waiting_lora_adapters=st.waiting_lora_adapters,
            max_lora=st.max_lora,
            kv_tiers=[
                pb.KVTierLoad(
                    tier=t.tier,
                    capacity_bytes=t.capacity_bytes,
                    bytes=t.bytes,
                    entries=t.entries,
                    hits=t.hits,
                    stored=t.stored,
                    evicted=t.evicted,
                    rejected=t.rejected,
                    load_seconds=t.load_seconds,
                )
                for t in st.kv_tiers
            ],
        )


class CallAbandoned(Exception):
    """``EngineLoop.call`` stopped waiting; the message says why."""


def _engine_id(s: Session, request_id: str) -> str:
    # Request ids are the gateway's; the session prefix keeps two gateways' ids apart in one engine.
    return f"{s.session_id}/{request_id}"
