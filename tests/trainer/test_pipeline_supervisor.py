"""Supervisor with real threads: first failure wins and wakes everyone, bounded shutdown, stall report."""

from __future__ import annotations

import threading
import time

import pytest

from trainer.pipeline.assignment import Assignment, FaultPoints, GlobalOrder, InjectedFault
from trainer.pipeline.channel import ChannelGroup
from trainer.pipeline.worker_supervisor import Supervisor, WorkerFailed

pytestmark = pytest.mark.timeout(30)


def _explode() -> None:
    raise ValueError("bad shard 7")


def test_first_failure_is_reraised_with_worker_name_and_traceback_and_wakes_blocked_peers() -> None:
    channels = ChannelGroup(threading.Event())
    queue = channels.new("target0->drafter0", 1)
    supervisor = Supervisor(channels, join_timeout_s=5)
    supervisor.spawn("drafter0", "drafter", lambda: queue.get(timeout=60))  # blocks until woken
    time.sleep(0.05)
    supervisor.spawn("target0", "target", _explode)
    deadline = time.monotonic() + 5
    while supervisor.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(WorkerFailed) as info:
        supervisor.check()
    assert info.value.worker == "target0" and isinstance(info.value.cause, ValueError)
    assert "worker target0 failed: ValueError: bad shard 7" in str(info.value)
    assert "_explode" in info.value.worker_traceback
    assert supervisor.shutdown() == []  # the blocked drafter was woken by the abort and left
    assert [s.phase for s in supervisor.states()] == ["stopped", "failed: ValueError"]


def test_shutdown_names_a_thread_that_does_not_stop_instead_of_hanging() -> None:
    channels = ChannelGroup(threading.Event())
    supervisor = Supervisor(channels, join_timeout_s=0.3)
    release = threading.Event()
    supervisor.spawn("drafter0", "drafter", lambda: release.wait(10))  # ignores the stop event (stuck in a kernel)
    started = time.monotonic()
    assert supervisor.shutdown() == ["drafter0"]
    assert time.monotonic() - started < 2
    release.set()


def test_a_worker_that_returns_early_while_the_run_is_active_is_an_error() -> None:
    supervisor = Supervisor(ChannelGroup(threading.Event()))
    supervisor.spawn("target0", "target", lambda: None)
    time.sleep(0.1)
    supervisor.check()  # finished normally: fine
    supervisor._states["target0"].phase = "loading"  # as if the thread had died without reporting
    with pytest.raises(RuntimeError, match="exited without an error"):
        supervisor.check()


def test_stall_report_says_which_side_starves() -> None:
    channels = ChannelGroup(threading.Event())
    channels.new("target0->drafter0", 2)
    supervisor = Supervisor(channels)
    release = threading.Event()
    supervisor.spawn("drafter0", "drafter", lambda: release.wait(5))
    supervisor.spawn("target0", "target", lambda: release.wait(5))
    supervisor.set_phase("drafter0", "waiting for features 4 from target0->drafter0")
    supervisor.set_phase("target0", "target forward 4")
    report = supervisor.stall_report()
    assert report.startswith("drafters starve: drafter0 wait for features")
    assert "target0->drafter0=0/2" in report and "target0 (target): target forward 4" in report
    supervisor.set_phase("drafter0", "forward/backward step 2")
    supervisor.set_phase("target0", "blocked on full queue target0->drafter0")
    assert supervisor.stall_report().startswith("targets starve for room: target0")
    release.set()
    supervisor.shutdown()


def test_assignment_is_deterministic_balanced_and_step_major() -> None:
    assignment = Assignment(num_targets=5, num_drafters=3, grad_accum=2)
    assert assignment.per_step == 6
    assert [assignment.micro_index(1, d, a) for d in range(3) for a in range(2)] == list(range(6, 12))
    assert [assignment.target_of(g) for g in range(6)] == [0, 1, 2, 3, 4, 0]
    assert list(assignment.indices_of_target(2, 10, 30)) == [12, 17, 22, 27]
    assert "target4 (cuda:4) -> drafter0 (cuda:5)" in assignment.describe(
        [f"cuda:{i}" for i in range(5)], ["cuda:5", "cuda:6", "cuda:7"]
    )
    with pytest.raises(ValueError, match="at least one target worker"):
        Assignment(0, 1, 1)


def test_global_order_maps_micro_batches_to_data_positions() -> None:
    order = GlobalOrder([3, 2])
    assert [order.position(g) for g in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
    assert order.index(1, 1) == 4 and order.index(2, 0) == 5
    with pytest.raises(IndexError):
        order.position(6)


def test_fault_points_fire_once_on_the_given_occurrence_and_reject_bad_specs() -> None:
    faults = FaultPoints(["target0.put@2"])
    faults.hit("target0.put")
    with pytest.raises(InjectedFault, match="target0.put"):
        faults.hit("target0.put")
    faults.hit("target0.put")
    with pytest.raises(ValueError, match="NAME@N"):
        FaultPoints(["target0.put"])
    with pytest.raises(ValueError, match="NAME@N"):
        FaultPoints(["target0.put@1=explode"])
