"""Faults on purpose, for the fault suite: a forward pass that raises, or one that stalls.

Read from the environment of the engine process only, so that nothing a client sends can turn
them on, and installed after the warm-up (step 1 is the first step that serves a client):

    LLMSERVE_FAULT_FORWARD_RAISE_AT_STEP=N   the N-th forward pass raises RuntimeError
    LLMSERVE_FAULT_FORWARD_STALL_AT_STEP=N   the N-th forward pass sleeps first ...
    LLMSERVE_FAULT_FORWARD_STALL_S=S         ... for S seconds (default 3600: a hang)
    LLMSERVE_FAULT_ARMED_BY=PATH             forward passes count only once PATH exists
    LLMSERVE_FAULT_STALL_UNTIL=PATH          ... and a stall ends early once PATH exists

A test that means "a fault while my streams run" opens its streams, then creates the ARMED_BY file:
the fault comes after the event it waits for, however slow the machine (a step count alone can be
reached before the last stream opens). STALL_UNTIL lets it say when a stall is over, after it has
seen what the stall causes.

The wrap sits on the model runner's ``execute``, the one call that runs the model, so that the
engine's own bookkeeping around it reacts to the fault as it would to a real one.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("engine_svc.server")

RAISE_AT = "LLMSERVE_FAULT_FORWARD_RAISE_AT_STEP"
STALL_AT = "LLMSERVE_FAULT_FORWARD_STALL_AT_STEP"
STALL_S = "LLMSERVE_FAULT_FORWARD_STALL_S"
ARMED_BY = "LLMSERVE_FAULT_ARMED_BY"
STALL_UNTIL = "LLMSERVE_FAULT_STALL_UNTIL"


class InjectedFault(RuntimeError):
    pass


def install_from_env(engine, env=os.environ) -> bool:
    raise_at = int(env.get(RAISE_AT, "0") or 0)
    stall_at = int(env.get(STALL_AT, "0") or 0)
    stall_s = float(env.get(STALL_S, "3600") or 3600)
    if raise_at <= 0 and stall_at <= 0:
        return False
    armed_by = env.get(ARMED_BY) or None
    stall_until = env.get(STALL_UNTIL) or None
    runner = engine.runner
    execute = runner.execute
    calls = 0
    armed = armed_by is None

    def faulty_execute(*args, **kwargs):
        nonlocal calls, armed
        if args and not getattr(args[0], "seq_ids", True):
            return execute(*args, **kwargs)  # nothing scheduled: the batch follows the KV changes only
        if not armed:
            if not os.path.exists(armed_by):
                return execute(*args, **kwargs)
            armed = True
            log.warning("fault injection: armed (%s exists)", armed_by)
        calls += 1
        if calls == raise_at:
            log.error("fault injection: forward pass %d raises", calls)
            raise InjectedFault(f"injected fault in forward pass {calls}")
        if calls == stall_at:
            log.error("fault injection: forward pass %d stalls for %.1fs", calls, stall_s)
            _stall(stall_s, stall_until)
            log.warning("fault injection: the stall of forward pass %d is over", calls)
        return execute(*args, **kwargs)

    runner.execute = faulty_execute
    log.warning("fault injection is ON (%s=%s, %s=%s)", RAISE_AT, raise_at or "-", STALL_AT, stall_at or "-")
    return True


def _stall(seconds: float, until: str | None) -> None:
    if until is None:
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while not os.path.exists(until) and time.monotonic() < end:
        time.sleep(0.02)
