"""The stall rule and the watchdog around it, on a fake clock; the forward-pass fault wrap."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from engine_svc.rpc.stall import StallDetector
from engine_svc.server.fault_injection import InjectedFault, install_from_env
from engine_svc.server.watchdog import Watchdog


def test_stalled_only_while_work_is_pending_past_the_timeout():
    d = StallDetector(2.0)
    d.update(0.0, pending=False, progressed=True)
    assert not d.stalled(100.0)  # idle for ages: not a stall
    d.update(100.0, pending=True, progressed=False)  # work arrives: the clock starts now
    assert not d.stalled(101.9)
    assert d.stalled(102.1)
    assert d.stalled_for(102.1) == pytest.approx(2.1)
    d.update(102.5, pending=True, progressed=True)  # a step completed, more work pending
    assert not d.stalled(104.4)
    d.update(104.5, pending=True, progressed=False)  # still pending: the clock is not reset
    assert d.stalled(104.6)
    d.update(105.0, pending=False, progressed=True)
    assert not d.stalled(1000.0)
    assert not StallDetector(0).stalled(1e9) and not StallDetector(-1).stalled(1e9)


def test_watchdog_trips_once_per_stall_and_reports_recovery():
    now = [0.0]
    events = []
    w = Watchdog(
        1.0,
        on_stall=lambda s: events.append(("stall", s)),
        on_recover=lambda: events.append("ok"),
        clock=lambda: now[0],
    )
    w.idle()
    now[0] = 10.0
    assert not w.check()
    w.step_started()
    now[0] = 10.5
    assert not w.check()
    now[0] = 11.5
    assert w.check() and w.tripped
    now[0] = 20.0
    assert not w.check()  # still the same stall: no second report
    w.step_finished(pending=True)
    assert not w.tripped
    w.step_started()
    now[0] = 20.5
    assert not w.check()
    assert events == [("stall", 1.5), "ok"]


def test_watchdog_thread_sees_a_stuck_step_in_real_time():
    tripped = threading.Event()
    w = Watchdog(0.2, on_stall=lambda s: tripped.set(), on_recover=lambda: None)
    w.start()
    try:
        w.idle()
        time.sleep(0.4)
        assert not tripped.is_set()
        w.step_started()  # and never finishes
        assert tripped.wait(60)
    finally:
        w.stop()


def test_forward_faults_count_forward_passes_after_install():
    calls = []
    engine = SimpleNamespace(runner=SimpleNamespace(execute=lambda *a: calls.append(a) or "ran"))
    assert not install_from_env(engine, env={})
    assert install_from_env(engine, env={"LLMSERVE_FAULT_FORWARD_RAISE_AT_STEP": "3"})
    assert engine.runner.execute(1) == "ran" and engine.runner.execute(2) == "ran"
    with pytest.raises(InjectedFault):
        engine.runner.execute(3)
    assert engine.runner.execute(4) == "ran"
    assert calls == [(1,), (2,), (4,)]

    engine = SimpleNamespace(runner=SimpleNamespace(execute=lambda: "ran"))
    stall = {"LLMSERVE_FAULT_FORWARD_STALL_AT_STEP": "1", "LLMSERVE_FAULT_FORWARD_STALL_S": "0.2"}
    install_from_env(engine, env=stall)
    t0 = time.monotonic()
    assert engine.runner.execute() == "ran"
    assert time.monotonic() - t0 >= 0.2


def test_an_armed_fault_counts_only_after_its_file_exists_and_a_stall_ends_when_told(tmp_path):
    """ARMED_BY: forward passes before the file exists are not counted (a test's streams open first);
    STALL_UNTIL: the stalled pass runs on once that file exists, not after its hour."""
    armed, over = tmp_path / "armed", tmp_path / "over"
    calls = []
    engine = SimpleNamespace(runner=SimpleNamespace(execute=lambda *a: calls.append(a) or "ran"))
    env = {"LLMSERVE_FAULT_FORWARD_RAISE_AT_STEP": "2", "LLMSERVE_FAULT_ARMED_BY": str(armed)}
    assert install_from_env(engine, env=env)
    for i in range(5):
        assert engine.runner.execute(i) == "ran"
    armed.touch()
    assert engine.runner.execute(5) == "ran"  # the first pass counted
    with pytest.raises(InjectedFault, match="forward pass 2"):
        engine.runner.execute(6)
    assert calls == [(i,) for i in range(6)]

    ran = threading.Event()
    engine = SimpleNamespace(runner=SimpleNamespace(execute=lambda: ran.set()))
    stall = {"LLMSERVE_FAULT_FORWARD_STALL_AT_STEP": "1", "LLMSERVE_FAULT_STALL_UNTIL": str(over)}
    install_from_env(engine, env=stall)  # for the default hour, unless told
    t = threading.Thread(target=engine.runner.execute, daemon=True)
    t.start()
    assert not ran.wait(0.3)  # stalled
    over.touch()
    assert ran.wait(60), "the stall did not end when its file appeared"
    t.join(60)
