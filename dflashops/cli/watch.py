"""`dflashops watch [RUN|--all] [--target T] [--interval S] [--once] [--json]`: a live view of runs.

A rich table refreshed every `--interval` seconds, the one `status` prints (cli/run_table.py): running
runs first, state (a word), step, loss, tau_sim, block tok/s, ETA, heartbeat age, exit code; ended runs with
their end state and no ETA or heartbeat age; per run its error or last log line (not wandb's housekeeping),
plus the target's GPUs (memory and utilisation). `watch RUN` ends when the run ends: exit 0 when it finished
or was stopped, 7 (`error:` with how it ended) when it crashed or was lost. When the target stops answering, the last data stays on screen
with `STALE <n>s` and the error, and each refresh tries again. `q` quits (keys are read from the tty
without blocking; Ctrl-C works too). `--once` renders one frame to stdout; `--json` prints one snapshot.
May change: nothing. It only reads (ops/observe/watch.py): no observer step, so a dead supervisor is shown as
"supervisor died, NOT restarted" and left for `status` to start again; the lineage is opened read-only.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.text import Text

from dflashops.cli.common import emit_json, open_invocation, output_console
from dflashops.cli.run_table import detail_lines, gpu_table, ordered, runs_table
from dflashops.core.errors import NotFound, RunFailed, UsageError
from dflashops.ops.observe.watch import LIVE_STATES, Watcher


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("watch", help="live view of a run (or --all runs of a target); q quits")
    p.add_argument("run", nargs="?", help="the run to watch")
    p.add_argument("--all", action="store_true", help="every run on the target")
    p.add_argument("--target", help="target (default: the run's recorded target, or the default target)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="render one frame and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.set_defaults(func=handle_watch)


def render(watcher: Watcher, title: str) -> Group:
    """One frame: a header line (fresh or STALE), the runs table (cli/run_table.py, the one `status` prints),
    per-run detail lines, the GPU table."""
    snapshot = watcher.snapshot
    assert snapshot is not None
    updated = time.strftime("%H:%M:%S", time.localtime(snapshot.taken_at))
    if watcher.stale_for is not None:
        header = Text(
            f"{title} | STALE {watcher.stale_for:.0f}s (last data {updated}); reconnecting: {watcher.error}",
            style="bold",
        )
    else:
        header = Text(f"{title} | updated {updated} | q quits")
    details = [
        Text(line, overflow="ellipsis", no_wrap=True) for row in ordered(snapshot.runs) for line in detail_lines(row)
    ]
    if not snapshot.runs:
        details.append(Text("no runs on this target yet"))
    parts: list[Any] = [header, runs_table(snapshot.runs), *details]
    if snapshot.gpus:
        parts.append(gpu_table(snapshot.gpus))
    else:
        parts.append(Text("gpus: none visible (no nvidia-smi on the target)"))
    return Group(*parts)


def ended(watcher: Watcher, *, quiet: bool = False) -> int | None:
    """For `watch RUN`: None while any of the run's rows (one per node) is live; else 0 when it finished or
    was stopped. A run that crashed or was lost raises RunFailed with how it ended (`quiet`: returns 7)."""
    snapshot = watcher.snapshot
    if snapshot is None or not snapshot.runs or any(row.state in LIVE_STATES for row in snapshot.runs):
        return None
    failed = [row for row in snapshot.runs if row.state in ("crashed", "lost")]
    if failed and quiet:
        return RunFailed.exit_code
    if failed:
        row = failed[0]
        step = f" at step {row.step}" if row.step is not None else ""
        error = f": {row.error_line.strip().removeprefix('error: ')}" if row.error_line else ""
        raise RunFailed(
            f"{row.name} {row.state}{step}, exit code {row.exit_code}{error}", hint=f"dflashops logs {row.name}"
        )
    return 0


@contextmanager
def keys() -> Iterator[Any]:
    """A function(timeout) -> key or None, reading the tty in cbreak mode (restored on exit). Without a
    tty it only sleeps (quit with Ctrl-C)."""
    stream = sys.stdin
    if not stream.isatty():
        yield lambda timeout: time.sleep(timeout)
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def read(timeout: float) -> str | None:
            ready, _, _ = select.select([fd], [], [], timeout)
            return os.read(fd, 1).decode(errors="ignore") if ready else None

        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def handle_watch(args: argparse.Namespace) -> int:
    if args.run and args.all:
        raise UsageError("give a RUN or --all, not both")
    if not args.run and not args.all:
        raise UsageError("watch needs a RUN or --all", hint="dflashops watch exp-flex6   or   dflashops watch --all")
    if args.interval <= 0:
        raise UsageError("--interval must be > 0")
    try:
        return watch(args)
    except KeyboardInterrupt:  # Ctrl-C ends the view as q does (the screen says q quits): not an error
        return 0


def watch(args: argparse.Namespace) -> int:
    """The view of handle_watch: one frame (--once, --json, an ended run), else live until q or the run's end."""
    with open_invocation(args, read_only=True) as invocation:
        watcher = Watcher(invocation, args.run, args.target)
        try:
            watcher.refresh()  # a run that does not exist, or an unreachable target, is an error right here
        except NotFound as exc:
            raise NotFound(exc.message, hint="`dflashops status` lists the runs of a target") from None
        if args.json:
            emit_json(watcher.to_dict())
            return 0
        title = f"dflashops watch {args.run or '--all'}"
        console = output_console()
        if args.once:
            console.print(render(watcher, title))
            return 0
        if args.run and ended(watcher, quiet=True) is not None:  # ended before the view started: one frame
            console.print(render(watcher, title))
            return ended(watcher) or 0
        with keys() as read_key, Live(render(watcher, title), console=console, auto_refresh=False) as live:
            next_refresh = time.monotonic() + args.interval
            while True:
                key = read_key(max(0.05, min(0.5, next_refresh - time.monotonic())))
                if key in ("q", "Q"):
                    return 0
                if time.monotonic() >= next_refresh:
                    watcher.refresh()
                    next_refresh = time.monotonic() + args.interval
                live.update(render(watcher, title), refresh=True)
                if args.run and (code := ended(watcher)) is not None:  # the last frame stays on screen
                    return code
