"""Start, watch and stop the pipeline's worker threads.

Contract:
- `spawn(name, role, fn)` runs `fn()` in a daemon thread. If it raises, the first such error is recorded with
  its formatted traceback, the run's stop event is set and every channel is aborted, so all other threads
  wake within one channel poll interval (0.1 s) and leave.
- The main thread never blocks without a timeout: it calls `check()` (raises `WorkerFailed` naming the worker,
  with the worker's traceback in the message) and `stall_report()` between bounded waits.
- `shutdown()` stops everything and joins each thread with a timeout; a thread that does not leave in time
  (stuck inside a CUDA call, say) is named in the returned list instead of hanging the process. Threads are
  daemons, so the interpreter can still exit.
- Workers publish what they are doing (`set_phase`), which lets a stall report say which side starves.
- A stop request (SIGTERM through trainer.core.signals.GracefulStop, or `stop_requested.set()`) is only looked at
  by the main thread's step loop at a step boundary; it writes one consistent checkpoint, then `shutdown()`.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.pipeline.channel import ChannelAborted, ChannelGroup


class WorkerFailed(RuntimeError):
    """A worker thread raised. `worker` is its name; `worker_traceback` the formatted traceback."""

    def __init__(self, worker: str, cause: BaseException, worker_traceback: str) -> None:
        self.worker = worker
        self.cause = cause
        self.worker_traceback = worker_traceback
        super().__init__(
            f"worker {worker} failed: {type(cause).__name__}: {cause}\n"
            f"--- traceback of {worker} ---\n{worker_traceback.rstrip()}"
        )


class PipelineStalled(RuntimeError):
    """No optimizer step completed for longer than the stall limit; the message says which side starves."""


@dataclass
class WorkerState:
    name: str
    role: str  # "target" or "drafter"
    phase: str = "starting"
    since: float = field(default_factory=time.monotonic)
    steps: int = 0


class Supervisor:
    def __init__(self, channels: ChannelGroup, *, join_timeout_s: float = 30.0) -> None:
        self.channels = channels
        self.stop_event = channels.stop_event
        self.stop_requested = threading.Event()  # graceful: finish the step, checkpoint, leave
        self.join_timeout_s = join_timeout_s
        self._threads: dict[str, threading.Thread] = {}
        self._states: dict[str, WorkerState] = {}
        self._lock = threading.Lock()
        self._failure: WorkerFailed | None = None
        self._shutting_down = False

    # -- workers ----------------------------------------------------------------------------------------
    def spawn(self, name: str, role: str, fn: Callable[[], None]) -> None:
        if name in self._threads:
            raise ValueError(f"duplicate worker name {name}")
        self._states[name] = WorkerState(name, role)
        thread = threading.Thread(target=self._run_worker, args=(name, fn), name=name, daemon=True)
        self._threads[name] = thread
        thread.start()

    def _run_worker(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.set_phase(name, "finished")
        except BaseException as exc:  # noqa: BLE001 - every error must reach the main thread
            if isinstance(exc, ChannelAborted) and (self._shutting_down or self._failure is not None):
                self.set_phase(name, "stopped")  # woken by a shutdown or by another worker's failure
                return
            self.fail(name, exc, traceback.format_exc())

    def fail(self, name: str, exc: BaseException, formatted_traceback: str) -> None:
        """Record the first failure, then stop the run and wake every thread."""
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = WorkerFailed(name, exc, formatted_traceback)
        self.set_phase(name, f"failed: {type(exc).__name__}")
        if first:
            self.stop_event.set()
            self.channels.abort_all(f"worker {name} failed ({type(exc).__name__}: {exc})")

    def set_phase(self, name: str, phase: str) -> None:
        state = self._states[name]
        state.phase, state.since = phase, time.monotonic()

    def count_step(self, name: str) -> None:
        self._states[name].steps += 1

    def states(self) -> list[WorkerState]:
        return list(self._states.values())

    # -- main-thread checks -----------------------------------------------------------------------------
    @property
    def failure(self) -> WorkerFailed | None:
        return self._failure

    def check(self) -> None:
        """Raise the first worker failure (chained to its original exception) or a dead-thread error."""
        if self._failure is not None:
            raise self._failure from self._failure.cause
        if self._shutting_down:
            return
        for name, thread in self._threads.items():
            if not thread.is_alive() and self._states[name].phase != "finished":
                raise RuntimeError(f"worker {name} exited without an error while the run was active")

    def stall_report(self) -> str:
        """Describe what each worker is doing and which side starves (for the log and PipelineStalled)."""
        now = time.monotonic()
        lines = [f"{s.name} ({s.role}): {s.phase} for {now - s.since:.1f} s, {s.steps} steps" for s in self.states()]
        waiting_drafters = [
            s.name for s in self.states() if s.role == "drafter" and s.phase.startswith("waiting for features")
        ]
        blocked_targets = [
            s.name for s in self.states() if s.role == "target" and s.phase.startswith("blocked on full")
        ]
        if waiting_drafters:
            verdict = (
                f"drafters starve: {', '.join(waiting_drafters)} wait for features (the target side is slow or stuck)"
            )
        elif blocked_targets:
            verdict = f"targets starve for room: {', '.join(blocked_targets)} are blocked on full queues (the drafter side is slow or stuck)"
        else:
            verdict = "neither side is waiting on a queue: a worker is stuck inside a step"
        depths = ", ".join(f"{c.name}={c.depth}/{c.capacity}" for c in self.channels.stats())
        return f"{verdict}; queues: {depths}\n  " + "\n  ".join(lines)

    # -- shutdown ---------------------------------------------------------------------------------------
    def shutdown(self, reason: str = "run finished") -> list[str]:
        """Stop all workers and join them (bounded). Return the names of threads still alive afterwards."""
        self._shutting_down = True
        self.stop_event.set()
        self.channels.abort_all(reason)
        deadline = time.monotonic() + self.join_timeout_s
        for thread in self._threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        return [name for name, thread in self._threads.items() if thread.is_alive()]
