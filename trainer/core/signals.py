"""Graceful stop on SIGTERM / SIGHUP / SIGINT.

First signal: remember it; the training loop finishes the current optimizer step, writes a checkpoint,
marks status.json `stopped` and exits with `128 + signum` (143 for SIGTERM, 129 for SIGHUP, 130 for
SIGINT) — the code a shell reports for a process ended by that signal, so `train && next` never runs
`next` after a stop, yet the checkpoint is there to resume from. Second signal: exit at once with the same
code (no checkpoint; status.json says so through `on_force`).

Handlers can only be installed from the main thread; elsewhere `GracefulStop` is inert (the caller — e.g.
the pipeline supervisor — owns signals then).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def stop_exit_code(signum: int) -> int:
    """Exit status after a signal-requested stop: 128 + signum."""
    return 128 + int(signum)


class GracefulStop:
    """Context manager: install the handlers on enter, restore the previous ones on exit."""

    def __init__(self, on_force: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self.on_force = on_force
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        assert self.signum is not None
        return stop_exit_code(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            print(
                f"received {name}: finishing the current step, then saving a checkpoint "
                f"(send it again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"received {name} again: exiting now without a checkpoint", file=sys.stderr, flush=True)
        if self.on_force is not None:
            try:
                self.on_force(signum)
            except Exception:  # noqa: BLE001 - we are leaving anyway; the exit code tells the story
                pass
        os._exit(stop_exit_code(signum))

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
