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


def test_a_step_whose_layers_advance_is_slow_not_hung():
    """A step ten timeouts long whose layers keep completing never trips; once its layers stop,
    it trips one timeout after the last one, and the step's end is a recovery."""
    now, layers = [0.0], [0]
    events = []
    w = Watchdog(
        1.0,
        on_stall=lambda s: events.append(("stall", s)),
        on_recover=lambda: events.append("ok"),
        clock=lambda: now[0],
        progress=lambda: layers[0],
    )
    w.idle()
    w.step_started()
    for _ in range(20):  # a layer every 0.5 s for 10 s
        now[0] += 0.5
        layers[0] += 1
        assert not w.check()
    now[0] += 0.9  # then stuck inside a layer
    assert not w.check()
    now[0] += 0.2
    assert w.check() and w.tripped
    assert events == [("stall", pytest.approx(1.1))]
    layers[0] += 1  # a layer after the trip: still the same stall, reported once
    now[0] += 5.0
    assert not w.check()
    w.step_finished(pending=False)
    assert events[-1] == "ok" and not w.tripped


def test_a_counter_that_does_not_move_is_no_progress():
    """A hang before the first layer (the fault suite's stalled forward pass) trips as before."""
    now = [0.0]
    w = Watchdog(
        1.0, on_stall=lambda s: None, on_recover=lambda: None, clock=lambda: now[0], progress=lambda: 7
    )
    w.idle()
    w.step_started()
    now[0] = 0.9
    assert not w.check()
    now[0] = 1.1
    assert w.check()


def test_watchdog_thread_follows_layer_progress_in_real_time():
    """On the watchdog's own thread: a step whose counter moves at every look outlives many
    timeouts untripped (counted in looks, not seconds); once the counter freezes, it trips."""
    looks = [0]
    frozen = threading.Event()
    many_looks = threading.Event()
    tripped = threading.Event()

    def progress() -> int:
        if not frozen.is_set():
            looks[0] += 1
            if looks[0] >= 40:  # with a look every timeout / 4: ten timeouts
                many_looks.set()
        return looks[0]

    w = Watchdog(0.2, on_stall=lambda s: tripped.set(), on_recover=lambda: None, progress=progress)
    w.start()
    try:
        w.step_started()  # and its layers keep completing
        assert many_looks.wait(60.0)
        assert not tripped.is_set()
        frozen.set()
        assert tripped.wait(30.0)
    finally:
        w.stop()


@pytest.mark.parametrize(
    "cpu_per_s,runnable,trips",
    [
        (0.05, True, False),  # ready to run, 5% of a core: other processes have the CPU (starved)
        (0.05, False, True),  # nothing ready to run and little CPU: blocked (a deadlock)
        (1.0, True, True),  # a core's worth of CPU and no layer done: a loop that never ends
    ],
)
def test_a_starved_engine_is_not_hung(cpu_per_s, runnable, trips):
    now = [0.0]
    events = []
    w = Watchdog(
        1.0,
        on_stall=lambda s: events.append(s),
        on_recover=lambda: None,
        clock=lambda: now[0],
        cpu=lambda: (cpu_per_s * now[0], runnable),
    )
    w.step_started()
    assert not w.check()  # the wait begins: the CPU it had so far is noted
    for t in (0.5, 1.5, 3.0, 10.0):
        now[0] = t
        w.check()
    assert bool(events) == trips and w.tripped == trips
    assert w.starved == (not trips)  # what heartbeats tell the gateway, whose rule then waits too
    if not trips:  # once it gets the CPU back without a layer done, it is hung after all
        w._cpu = lambda: (0.05 * 10 + 1.0 * (now[0] - 10.0), True)
        now[0] = 40.0
        assert w.check() and w.tripped


def test_process_cpu_reads_this_process():
    from engine_svc.server.watchdog import process_cpu

    stop = threading.Event()
    spin = threading.Thread(target=lambda: [None for _ in iter(lambda: stop.is_set(), True)])
    spin.start()
    try:
        cpu, runnable = process_cpu()
        assert cpu > 0 and runnable  # the spinning thread is running or ready to run
    finally:
        stop.set()
        spin.join()
