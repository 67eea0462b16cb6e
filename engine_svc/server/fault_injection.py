"""Faults on purpose, for the fault suite: a forward pass that raises, or one that stalls.

Read from the environment of the engine process only, so that nothing a client sends can turn
them on, and installed after the warm-up (step 1 is the first step that serves a client):

    LLMSERVE_FAULT_FORWARD_RAISE_AT_STEP=N   the N-th forward pass raises RuntimeError
    LLMSERVE_FAULT_FORWARD_STALL_AT_STEP=N   the N-th forward pass sleeps first ...
    LLMSERVE_FAULT_FORWARD_STALL_S=S         ... for S seconds (default 3600: a hang)

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


class InjectedFault(RuntimeError):
    pass


def install_from_env(engine, env=os.environ) -> bool:
    raise_at = int(env.get(RAISE_AT, "0") or 0)
    stall_at = int(env.get(STALL_AT, "0") or 0)
    stall_s = float(env.get(STALL_S, "3600") or 3600)
    if raise_at <= 0 and stall_at <= 0:
        return False
    runner = engine.runner
    execute = runner.execute
    calls = 0

    def faulty_execute(*args, **kwargs):
        nonlocal calls
        if args and not getattr(args[0], "seqs", True):
            return execute(*args, **kwargs)  # nothing scheduled: the batch follows the KV changes only
        calls += 1
        if calls == raise_at:
            log.error("fault injection: forward pass %d raises", calls)
            raise InjectedFault(f"injected fault in forward pass {calls}")
        if calls == stall_at:
            log.error("fault injection: forward pass %d stalls for %.1fs", calls, stall_s)
            time.sleep(stall_s)
        return execute(*args, **kwargs)

    runner.execute = faulty_execute
    log.warning("fault injection is ON (%s=%s, %s=%s)", RAISE_AT, raise_at or "-", STALL_AT, stall_at or "-")
    return True
