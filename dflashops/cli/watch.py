"""`dflashops watch [RUN|--all] [--target T] [--interval S] [--once] [--json]`: a live view of runs.

A rich table refreshed every `--interval` seconds: state (a word), step, loss, tau_sim, block tok/s
(total and per drafter), queue depths, GPU memory, ETA, heartbeat age and the last log line, plus the
target's GPUs (memory and utilisation). When the target stops answering, the last data stays on screen
with `STALE <n>s` and the error, and each refresh tries again. `q` quits (keys are read from the tty
without blocking; Ctrl-C works too). `--once` renders one frame to stdout; `--json` prints one snapshot.
It never changes a run: it only reads (ops/watch.py).
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

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dflashops.cli.common import emit_json, open_invocation
from dflashops.errors import NotFound, UsageError
from dflashops.ops.watch import RunRow, Watcher


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("watch", help="live view of a run (or --all runs of a target); q quits")
    p.add_argument("run", nargs="?", help="the run to watch")
    p.add_argument("--all", action="store_true", help="every run on the target")
    p.add_argument("--target", help="target (default: the run's recorded target, or the default target)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="render one frame and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.set_defaults(func=handle_watch)


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _state(row: RunRow) -> str:
    state = row.state
    if row.state == "running" and row.phase and row.phase != "training":
        state = f"running ({row.phase})"
    if row.supervision and row.supervision.startswith("supervisor died"):
        state += f" [{row.supervision}]"  # a helper that went silent is said, never shown by colour alone
    return state


def render(watcher: Watcher, title: str) -> Group:
    """One frame: a header line (fresh or STALE), the runs table, per-run detail lines, the GPU table."""
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
    runs = Table(expand=False, pad_edge=False)
    for column in ("run", "state", "step", "loss", "tau_sim", "blk tok/s", "eta", "beat"):
        runs.add_column(column, no_wrap=True)
    details: list[Text] = []
    for row in snapshot.runs:
        step = "-" if row.step is None else (f"{row.step}/{row.total_steps}" if row.total_steps else str(row.step))
        runs.add_row(
            row.name,
            _state(row),
            step,
            _num(row.loss),
            _num(row.tau_sim),
            _num(row.block_tok_s),
            _eta(row.eta_s),
            "-" if row.heartbeat_age_s is None else f"{row.heartbeat_age_s:.0f}s",
        )
        facts = [
            f"drafters {' '.join(_num(v) for v in row.block_tok_s_per_drafter)} tok/s"
            if row.block_tok_s_per_drafter
            else "",
            f"queues {' '.join(f'{k}={v}' for k, v in row.queues.items())}" if row.queues else "",
            f"gpu mem {' '.join(f'{k}:{v:.1f}GB' for k, v in row.gpu_mem_gb.items())}" if row.gpu_mem_gb else "",
        ]
        if any(facts):
            details.append(Text(f"{row.name}: " + " | ".join(f for f in facts if f), overflow="fold"))
        line = row.error_line if row.error_line else row.last_log_line
        details.append(
            Text(
                f"{row.name} {'error' if row.error_line else 'log'}: {(line or '-').strip()}",
                overflow="ellipsis",
                no_wrap=True,
            )
        )
    if not snapshot.runs:
        details.append(Text("no runs on this target yet"))
    parts: list[Any] = [header, runs, *details]
    if snapshot.gpus:
        gpus = Table(expand=False)
        for column in ("gpu", "name", "memory MiB", "util %"):
            gpus.add_column(column)
        for gpu in snapshot.gpus:
            gpus.add_row(
                f"{gpu.target}:{gpu.index}",
                gpu.name,
                f"{gpu.memory_used_mib}/{gpu.memory_total_mib}",
                str(gpu.utilization_pct),
            )
        parts.append(gpus)
    else:
        parts.append(Text("gpus: none visible (no nvidia-smi on the target)"))
    return Group(*parts)


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
    with open_invocation(args) as invocation:
        watcher = Watcher(invocation, args.run, args.target)
        try:
            watcher.refresh()  # a run that does not exist, or an unreachable target, is an error right here
        except NotFound as exc:
            raise NotFound(exc.message, hint="`dflashops status` lists the runs of a target") from None
        if args.json:
            emit_json(watcher.to_dict())
            return 0
        title = f"dflashops watch {args.run or '--all'}"
        console = Console(highlight=False)
        if args.once:
            console.print(render(watcher, title))
            return 0
        with keys() as read_key, Live(render(watcher, title), console=console, auto_refresh=False) as live:
            next_refresh = time.monotonic() + args.interval
            while True:
                try:
                    key = read_key(max(0.05, min(0.5, next_refresh - time.monotonic())))
                except KeyboardInterrupt:
                    return 0
                if key in ("q", "Q"):
                    return 0
                if time.monotonic() >= next_refresh:
                    watcher.refresh()
                    next_refresh = time.monotonic() + args.interval
                live.update(render(watcher, title), refresh=True)
