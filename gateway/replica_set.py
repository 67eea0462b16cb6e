"""Several engine replicas behind one gateway, presented as the one EngineClient the gateway knows.

Each replica keeps its own EngineClient (session, heartbeat, reconnection); a replica whose
session is lost is out of the routing at once and back in when its session reopens. ``submit``
asks the router (gateway/router.py) for a replica, given the prompt's affinity key and every
healthy replica's load; when the submit itself finds the replica gone, the next choice is tried.

A request whose replica is lost before it delivered anything to its client is submitted again
elsewhere (nothing was streamed, so the client cannot tell); one that has streamed ends with
UNAVAILABLE, as it would with a single engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.engine_client import EngineClient, EngineDelta, EngineUnavailable, RequestHandle
from gateway.router import ReplicaLoad, RoutingPolicy, choose_replica, prefix_key, rendezvous_rank
from llmserve_proto.engine.v1 import engine_pb2 as pb

log = logging.getLogger("gateway.replicas")


class RoutedHandle:
    """A request's deltas from whichever replica runs it now (the RequestHandle interface)."""

    def __init__(self, replicas: ReplicaSet, request_id: str, submit_args: tuple, retries: int) -> None:
        self.request_id = request_id
        self._replicas = replicas
        self._submit_args = submit_args  # prompt, params, priority, cache_salt, lora, client: to submit again
        self._retries_left = retries
        self._inner: RequestHandle | None = None
        self._delivered = False
        self._interrupt: BaseException | None = None  # a drain's abort that came between two replicas
        self._on_pause: Callable[[bool], None] | None = None

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self._inner.finished = value

    @property
    def paused(self) -> bool:
        return self._inner is not None and self._inner.paused

    def stalled_for(self, now: float) -> float:
        return self._inner.stalled_for(now) if self._inner is not None else 0.0

    def unread_since(self) -> float | None:
        return self._inner.unread_since() if self._inner is not None else None

    def sending(self, pending: bool) -> None:
        if self._inner is not None:
            self._inner.sending(pending)

    def watch_pause(self, callback: Callable[[bool], None]) -> None:
        self._on_pause = callback
        if self._inner is not None:
            self._inner.watch_pause(callback)

    def _replace_inner(self, inner: RequestHandle) -> None:
        was_paused = self.paused
        self._inner = inner
        if self._on_pause is not None:
            if was_paused:
                self._on_pause(False)  # the new replica's request starts unpaused
            inner.watch_pause(self._on_pause)

    def _put(self, item) -> None:
        self._interrupt = item
        self._inner._put(item)

    async def next_deltas(self) -> list[EngineDelta]:
        while True:
            try:
                deltas = await self._inner.next_deltas()
            except EngineUnavailable:
                if self._delivered or self._retries_left <= 0 or self._interrupt is not None:
                    raise
                self._retries_left -= 1
                await self._replicas._resubmit(self)
                if self._interrupt is not None:
                    raise self._interrupt from None
                continue
            self._delivered = True
            return deltas


class ReplicaSet:
    def __init__(
        self, replicas: list[EngineClient], policy: RoutingPolicy | None = None, retries: int = 1
    ) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one engine")
        self.replicas = replicas
        self.policy = policy or RoutingPolicy()
        self.retries = retries
        self.on_state_change: Callable[[bool], None] | None = None
        self._inflight: dict[str, int] = {r.address: 0 for r in replicas}
        self._owner: dict[str, EngineClient] = {}  # request id -> the replica that runs it
        self._handles: dict[str, RoutedHandle] = {}
        self._ready = asyncio.Event()
        # Set (and replaced) each time a replica is lost: what a pending submit to it waits on.
        self._lost_events = {r.address: asyncio.Event() for r in replicas}
        self.routed: dict[str, int] = {}  # routing reason -> count (logs, tests)
        for r in replicas:
            r.on_state_change = lambda up, r=r: self._replica_changed(r, up)

    # What the gateway reads --------------------------------------------------------------------

    @property
    def address(self) -> str:
        return ",".join(r.address for r in self.replicas)

    @property
    def healthy(self) -> list[EngineClient]:
        return [r for r in self.replicas if r.ready]

    @property
    def ready(self) -> bool:
        return bool(self.healthy)

    @property
    def info(self) -> pb.EngineInfo | None:
        """The first healthy replica's info, with the limits every healthy replica can meet."""
        up = [r.info for r in self.healthy if r.info is not None]
        if not up:
            known = [r.info for r in self.replicas if r.info is not None]
            return known[0] if known else None
        merged = pb.EngineInfo()
        merged.CopyFrom(up[0])
        merged.max_model_len = min(i.max_model_len for i in up)
        merged.num_kv_blocks = min(i.num_kv_blocks for i in up)
        merged.max_logprobs = min(i.max_logprobs for i in up)
        return merged

    @property
    def load(self) -> pb.Load:
        return sum_loads(r.load for r in self.healthy)

    @property
    def transport(self) -> str:
        kinds = {r.transport for r in self.healthy} or {r.transport for r in self.replicas}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    # The gateway sets these callbacks (metrics) on its engine link: every replica must call them.
    @property
    def on_step_time(self) -> Callable[[float], None] | None:
        return self.replicas[0].on_step_time

    @on_step_time.setter
    def on_step_time(self, fn: Callable[[float], None] | None) -> None:
        for r in self.replicas:
            r.on_step_time = fn

    @property
    def on_lost(self) -> Callable[[str], None] | None:
        return self.replicas[0].on_lost

    @on_lost.setter
    def on_lost(self, fn: Callable[[str], None] | None) -> None:
        for r in self.replicas:
            r.on_lost = fn

    def replica_loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(
                name=r.address,
                inflight=self._inflight[r.address],
                running=r.load.num_running,
                waiting=r.load.num_waiting,
                kv_usage=r.load.kv_blocks_used / max(1, r.load.kv_blocks_total),
            )
            for r in self.healthy
        ]

    # Lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        for r in self.replicas:
            await r.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas))

    def _replica_changed(self, replica: EngineClient, up: bool) -> None:
        was_ready = self._ready.is_set()
        if not up:
            lost, self._lost_events[replica.address] = self._lost_events[replica.address], asyncio.Event()
            lost.set()
        (log.info if up else log.warning)(
            "replica %s is %s (%d of %d healthy)",
            replica.address,
            "in" if up else "out",
            len(self.healthy),
            len(self.replicas),
        )
        if self.ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self.ready != was_ready and self.on_state_change is not None:
            self.on_state_change(self.ready)

    # Requests -------------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: pb.SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        lora: str = "",
        client: str = "",
    ) -> RoutedHandle:
        handle = RoutedHandle(
            self, request_id, (prompt, params, priority, cache_salt, lora, client), self.retries
        )
        await self._place(handle, avoid=None)
        return handle

    async def _resubmit(self, handle: RoutedHandle) -> None:
        lost = self._owner.get(handle.request_id)
        self._untrack(handle.request_id)
        log.warning("request %s lost its replica before any output; submitting it again", handle.request_id)
        await self._place(handle, avoid=lost)

    async def _place(self, handle: RoutedHandle, avoid: EngineClient | None) -> None:
        prompt, params, priority, cache_salt, lora, client = handle._submit_args
        rid = handle.request_id
        tried: set[str] = set() if avoid is None else {avoid.address}
        while True:
            replica = self._choose(rid, prompt, cache_salt, exclude=tried)
            if replica is None:
                raise EngineUnavailable("no engine replica is available")
            self._track(rid, replica, handle)  # before Submit: the first delta may beat its reply
            try:
                handle._replace_inner(
                    await self._submit_unless_lost(
                        replica,
                        replica.submit(
                            rid, prompt, params, priority, cache_salt=cache_salt, lora=lora, client=client
                        ),
                    )
                )
                return
            except EngineUnavailable:
                self._untrack(rid)
                tried.add(replica.address)
            except BaseException:
                self._untrack(rid)
                raise

    async def _submit_unless_lost(self, replica: EngineClient, submit) -> RequestHandle:
        """The Submit, given up as soon as the replica is declared lost: a frozen engine (no
        heartbeat) would otherwise hold it until the RPC's own timeout. The engine drops whatever
        reaches it from the closed session."""
        lost = self._lost_events[replica.address]
        submit_task = asyncio.ensure_future(submit)
        lost_task = asyncio.ensure_future(lost.wait())
        try:
            done, _ = await asyncio.wait({submit_task, lost_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost_task.cancel()
            if not submit_task.done():
                submit_task.cancel()
        if submit_task in done:
            return submit_task.result()
        raise EngineUnavailable(f"replica {replica.address} was lost during the submit")

    def _choose(self, rid: str, prompt: list[int], cache_salt: str, exclude: set[str]) -> EngineClient | None:
        loads = [r for r in self.replica_loads() if r.name not in exclude]
        if not loads:
            return None
        info = self.info
        key = prefix_key(prompt, info.block_size if info else 0, self.policy.prefix_blocks, cache_salt)
        choice = choose_replica(key, loads, self.policy, tiebreak=rid.encode())
        self.routed[choice.reason] = self.routed.get(choice.reason, 0) + 1
        log.debug("request %s -> %s (%s)", rid, choice.name, choice.reason)
        return next(r for r in self.replicas if r.address == choice.name)

    def preferred(self, prompt: list[int], cache_salt: str = "") -> str | None:
        """The replica a prompt's affinity key ranks first among the healthy ones (tests, logs)."""
        info = self.info
        key = prefix_key(prompt, info.block_size if info else 0, self.policy.prefix_blocks, cache_salt)
        names = [r.address for r in self.healthy]
        return rendezvous_rank(key, names)[0] if key is not None and names else None

    def _track(self, rid: str, replica: EngineClient, handle: RoutedHandle) -> None:
        self._owner[rid] = replica
        self._handles[rid] = handle
        self._inflight[replica.address] += 1

    def _untrack(self, rid: str) -> EngineClient | None:
        replica = self._owner.pop(rid, None)
        self._handles.pop(rid, None)
        if replica is not None:
            self._inflight[replica.address] -= 1
        return replica

    def release(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is None:
            return
        replica.release(request_id)
        handle = self._handles.get(request_id)
        if handle is None or handle._inner is None or handle.finished:
            self._untrack(request_id)
        # else: the gateway aborts the rest next (client gone, stop string, drain); abort() needs
        # the owner, and untracks it.

    async def abort(self, request_ids: list[str], index: int | None = None) -> None:
        by_replica: dict[str, list[str]] = {}
        owners: dict[str, EngineClient] = {}
        for rid in request_ids:
            replica = self._owner.get(rid) if index is not None else self._untrack(rid)
            if replica is not None:
                by_replica.setdefault(replica.address, []).append(rid)
                owners[replica.address] = replica
        await asyncio.gather(*(owners[a].abort(rids, index) for a, rids in by_replica.items()))

    # LoRA adapters: every replica holds the same set ---------------------------------------------

    async def load_adapter(self, name: str, path: str) -> pb.AdapterInfo:
        """On every healthy replica (a refusal anywhere is the caller's error; replicas that loaded
        it keep it, as a load of the same name again replaces it)."""
        infos = await asyncio.gather(*(r.load_adapter(name, path) for r in self._all_up()))
        return infos[0]

    async def unload_adapter(self, name: str) -> None:
        await asyncio.gather(*(r.unload_adapter(name) for r in self._all_up()))

    async def list_adapters(self) -> pb.ListAdaptersResponse:
        return await self._all_up()[0].list_adapters()

    def _all_up(self) -> list[EngineClient]:
        healthy = self.healthy
        if not healthy:
            raise EngineUnavailable("no engine replica is available")
        return healthy

    async def stats(self, check_invariants: bool = False) -> pb.EngineStats:
        """Every healthy replica's stats, added up (an invariant error names its replica)."""
        healthy = self.healthy
        per = await asyncio.gather(*(r.stats(check_invariants) for r in healthy))
        total = pb.EngineStats(load=sum_loads(st.load for st in per))
        for r, st in zip(healthy, per, strict=True):
            for f in ("num_sessions", "num_live_requests"):
                setattr(total, f, getattr(total, f) + getattr(st, f))
            if st.invariant_error and not total.invariant_error:
                total.invariant_error = f"{r.address}: {st.invariant_error}"
        return total


def sum_loads(loads) -> pb.Load:
    """Replicas' loads added up, field by field: counts summed; the LoRA adapter names in use
    joined (each once); ``max_lora`` (slots per engine) the largest; the KV tiers' figures summed
    tier by tier."""
    total = pb.Load()
    names: dict[str, set[str]] = {}
    tiers: dict[str, pb.KVTierLoad] = {}
    for load in loads:
        for f in pb.Load.DESCRIPTOR.fields:
            if f.name == "kv_tiers":  # per KV tier: its figures summed over the replicas
                for t in load.kv_tiers:
                    into = tiers.setdefault(t.tier, pb.KVTierLoad(tier=t.tier))
                    for g in pb.KVTierLoad.DESCRIPTOR.fields:
                        if g.name != "tier":
                            setattr(into, g.name, getattr(into, g.name) + getattr(t, g.name))
            elif _repeated(f):
                names.setdefault(f.name, set()).update(getattr(load, f.name))
            elif f.name == "max_lora":
                total.max_lora = max(total.max_lora, load.max_lora)
            else:
                setattr(total, f.name, getattr(total, f.name) + getattr(load, f.name))
    for name, values in names.items():
        getattr(total, name).extend(sorted(values))
    total.kv_tiers.extend(tiers[name] for name in sorted(tiers))
    return total


def connect_engines(
    addresses: list[str], make_client: Callable[[str], EngineClient], policy: RoutingPolicy | None = None
) -> EngineClient | ReplicaSet:
    """One address: the plain EngineClient; several: a ReplicaSet over one client each."""
    if len(addresses) != len(set(addresses)):
        raise ValueError(f"an engine address is given twice: {addresses}")
    if len(addresses) == 1:
        return make_client(addresses[0])
    return ReplicaSet([make_client(a) for a in addresses], policy)


def _repeated(field) -> bool:
    # protobuf 7 has only ``is_repeated``; releases before 5.28 only ``label``.
    flag = getattr(field, "is_repeated", None)
    return flag if flag is not None else field.label == field.LABEL_REPEATED
