"""Cancel-on-supersede: an editor sends one completion per keystroke, each with the same
``supersede_key``; the newest cancels the one still in flight with that key (and that caller).

A claim is taken when the request is validated and given back when it ends. Taking a key that a
request holds marks that request superseded: if it is in the engine, its delta queue is handed
``Superseded`` (the stream raises it at once, like a drain's ``ServerAborting``), and the generation
path ends it as CANCELLED and aborts it in the engine, so it stops within one step; if it is still
being tokenized or admitted, it is ended as soon as it is submitted. Keys are per tenant
(``Identity.cache_salt``): one caller cannot cancel another's requests.
"""

from __future__ import annotations

from gateway.engine_client import RequestHandle


class Superseded(Exception):
    """Put into a request's delta queue when a newer request with its key arrived."""


class Claim:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.handle: RequestHandle | None = None
        self.superseded_by: str | None = None

    def attach(self, handle: RequestHandle) -> None:
        """The request is in the engine now; if superseded meanwhile, its stream ends at once."""
        self.handle = handle
        if self.superseded_by is not None:
            handle._put(Superseded(self.superseded_by))

    def supersede(self, by: str) -> None:
        if self.superseded_by is None:
            self.superseded_by = by
            if self.handle is not None:
                self.handle._put(Superseded(by))


class SupersedeKeys:
    def __init__(self) -> None:
        self._held: dict[tuple[str, str], Claim] = {}

    def claim(self, scope: str, key: str, request_id: str) -> Claim:
        """``request_id`` takes ``key``; the request that held it is superseded."""
        old = self._held.get((scope, key))
        if old is not None:
            old.supersede(request_id)
        claim = self._held[(scope, key)] = Claim(request_id)
        return claim

    def release(self, scope: str, key: str, claim: Claim) -> None:
        if self._held.get((scope, key)) is claim:
            del self._held[(scope, key)]

    def __len__(self) -> int:
        return len(self._held)
