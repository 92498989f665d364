"""`stop`, `status`, `logs`, `exec`, `attach`, `gc`: thin wrappers over dflashops.ops.

What each may change (docs/architecture.md "Reading and acting"):
- `status`: what the observer changes (ops/runs/observer.py): a dead supervisor started again (said on stderr), a
  supervisor-made run recorded, notifications queued (once each), the runs' lineage records following their state;
- `stop`: the run (signals), then what the observer changes; `gc`: the target's files it lists, the lineage's
  `collected` marks; `exec`: whatever the command does;
- `logs`, `attach`: nothing (the lineage is opened read-only: never created, migrated or written).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from dflashops.cli.common import (
    emit_json,
    follow_again,
    highlight_errors,
    moved_after_separator,
    open_invocation,
    output_console,
    print_plan,
    progress,
    show_passthrough,
    size,
)
from dflashops.core.errors import NotFound, TransportError, UsageError
from dflashops.core.shell import join_argv, validate_name
from dflashops.lineage.files import AGENT_STATE_TO_LINEAGE
from dflashops.lineage.record import utc_now_iso
from dflashops.ops.agent_client import GcAnswer, GpusAnswer, StopAnswer, answer_json
from dflashops.ops.runs.control import LogCursor, ended_badly, read_log, run_status, stop_run, target_status, wait_for
from dflashops.ops.runs.nodes import node_target, unreachable_error
from dflashops.ops.runs.observer import observe_runs

# `status` without RUN shows runs that have not ended and those that ended in the last day: a workspace keeps
# every run it ever had (47 KB of table at 500 runs); --all-runs and --json give all of them.
RECENT_S = 24 * 3600


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the parsers of `stop`, `status`, `logs`, `exec`, `attach` and `gc`, one step each."""
    add_stop_parser(subparsers)
    add_status_parser(subparsers)
    add_logs_parser(subparsers)
    add_exec_parser(subparsers)
    add_attach_parser(subparsers)
    add_gc_parser(subparsers)


def add_stop_parser(subparsers: argparse._SubParsersAction) -> None:
    """`stop RUN | --all`: signal, grace, kill and wait; handled by handle_stop."""
    p = subparsers.add_parser(
        "stop",
        help="stop a run: SIGTERM its process group, grace, SIGKILL, wait",
        description="Stop RUN (or --all runs): SIGTERM to the run's own process group so the trainer writes its "
        "final checkpoint, SIGKILL after --grace, then wait until its processes and GPU memory are gone. "
        "Nothing outside the run's process group is signalled.",
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="the run to stop (or give --all)")
    p.add_argument("--target", help="target (default: the one the lineage records for RUN)")
    add_all_options(p, "stop every running run on every target of the inventory, in parallel")
    p.add_argument(
        "--grace", type=float, default=60.0, metavar="S", help="seconds between SIGTERM and SIGKILL (default 60)"
    )
    p.add_argument(
        "--save-grace",
        type=float,
        default=600.0,
        metavar="S",
        help="more seconds for a run still writing its checkpoint after --grace (default 600)",
    )
    p.add_argument(
        "--now",
        action="store_true",
        help="SIGKILL the run at once, without its final checkpoint (the last periodic one stays), even while "
        "another stop or restart of it is in progress",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands that would run; change nothing")
    p.set_defaults(func=with_run_hint(handle_stop))


def add_status_parser(subparsers: argparse._SubParsersAction) -> None:
    """`status [RUN] [--all]`: the state of a run or of a target's runs; handled by handle_status."""
    s = subparsers.add_parser(
        "status",
        help="state of one run or of every run on a target",
        description="Show RUN's state (running / crashed at step N with the error line / finished / stopped), "
        "its last metrics and the target's GPUs; with no RUN, every run on the target; with --all, "
        "every run on every target of the inventory.",
    )
    s.add_argument("run", nargs="?", metavar="RUN", help="the run to show (default: every run on the target)")
    s.add_argument("--target", help="target (default: RUN's recorded target, or the default target)")
    s.add_argument("--json", action="store_true", help="machine-readable output on stdout (every run)")
    s.add_argument(
        "--all-runs",
        action="store_true",
        help=f"every run on the target (default: those not ended, and those that ended in the last {RECENT_S // 3600} h)",
    )
    add_all_options(s, "every run on every target of the inventory, in parallel (a table)")
    s.set_defaults(func=with_run_hint(handle_status))


def add_logs_parser(subparsers: argparse._SubParsersAction) -> None:
    """`logs RUN`: print or follow train.log, a check for scripts with --until/--fail-on; handled by handle_logs."""
    lg = subparsers.add_parser(
        "logs",
        help="print or follow a run's train.log",
        description="Print RUN's train.log, or follow it (-f) until the run ends. --until and --fail-on turn it "
        "into a check for scripts: exit 0 on a match of --until, 7 on --fail-on, 8 on --timeout.",
    )
    lg.add_argument("run", metavar="RUN", help="the run whose log to print")
    lg.add_argument("--target", help="target (default: RUN's recorded target, or the default target)")
    lg.add_argument(
        "--node",
        type=int,
        metavar="K",
        help="a run on several targets: only node K's log (default: every node's, lines prefixed [node K])",
    )
    lg.add_argument("-f", "--follow", action="store_true", help="keep following until the run ends")
    lg.add_argument(
        "--since",
        type=int,
        default=0,
        metavar="BYTES",
        help="start at this byte offset (a line start: one inside a line starts at the next line)",
    )
    lg.add_argument(
        "-n", "--tail", type=int, metavar="N", help="start at the last N lines of the log (with -f: then follow)"
    )
    lg.add_argument("--until", metavar="REGEX", help="follow until REGEX matches a line (exit 0)")
    lg.add_argument("--fail-on", metavar="REGEX", help="exit non-zero (7) when REGEX matches a line")
    lg.add_argument("--timeout", type=float, metavar="S", help="give up after this many seconds (exit 8)")
    lg.add_argument("--raw", action="store_true", help="no highlighting")
    lg.set_defaults(func=with_run_hint(handle_logs))


def add_exec_parser(subparsers: argparse._SubParsersAction) -> None:
    """`exec TARGET -- argv`: run a command on a target; handled by handle_exec."""
    ex = subparsers.add_parser(
        "exec",
        help="run a command on a target: dflashops exec TARGET -- argv",
        description="Run a command on TARGET (inside its container for pct targets) and pass its output and "
        "exit code through. Everything after `--` is the command, run without a shell.",
    )
    ex.add_argument("target", nargs="?", metavar="TARGET", help="target from the inventory (or give --all)")
    ex.add_argument("--dry-run", action="store_true", help="print the command that would run; run nothing")
    add_all_options(ex, "run the command on every target of the inventory, in parallel")
    show_passthrough(ex, "-- COMMAND [ARG ...]")
    ex.set_defaults(func=handle_exec, misplaced_words=exec_words_before_separator)


def add_attach_parser(subparsers: argparse._SubParsersAction) -> None:
    """`attach RUN`: a terminal on the run's tmux session; handled by handle_attach."""
    at = subparsers.add_parser(
        "attach",
        help="attach to a run's tmux session (for humans)",
        description="Attach this terminal to RUN's tmux session (over ssh and pct exec for remote targets). "
        "Detach with the tmux prefix + d; detaching never stops the run. Needs a terminal; "
        "scripts use `dflashops logs RUN -f`.",
    )
    at.add_argument("run", metavar="RUN", help="the run to attach to (launched with --launcher tmux)")
    at.add_argument("--target", help="target (default: RUN's recorded target, or the default target)")
    at.add_argument(
        "--node",
        type=int,
        metavar="K",
        default=None,
        help="a run on several targets: node K's tmux session (default: node 0)",
    )
    at.set_defaults(func=with_run_hint(handle_attach))


def add_gc_parser(subparsers: argparse._SubParsersAction) -> None:
    """`gc [TARGET]`: delete old releases and named run directories; handled by handle_gc."""
    gc = subparsers.add_parser(
        "gc",
        help="delete old releases and (only when named) finished run directories",
        description="Delete code releases on TARGET except the newest --keep, the current one and any a live run "
        "uses, and the run directories named with --run (only runs that are not running); with --standby, "
        "ask TARGET's standby interpreters to exit. Nothing else is deleted or stopped. Prints what was "
        "removed (path and size, one line each; --json for JSON); the lineage keeps a deleted run's record, "
        "marked collected.",
    )
    gc.add_argument(
        "target", nargs="?", metavar="TARGET", help="target from the inventory (default: the default target)"
    )
    gc.add_argument("--keep", type=int, default=5, metavar="N", help="releases to keep (default 5)")
    gc.add_argument("--run", action="append", default=[], metavar="RUN", help="a run directory to delete (repeatable)")
    gc.add_argument(
        "--standby",
        action="store_true",
        help="also retire the target's waiting standby interpreters (inventory `standby`)",
    )
    gc.add_argument("--json", action="store_true", help="print what was removed as JSON")
    gc.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted (paths and sizes); delete nothing"
    )
    gc.set_defaults(func=handle_gc)


def with_run_hint(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`handler`, with a "did you mean" hint (close names from the lineage and the target) added to the
    NotFound of a RUN that does not exist, as `restart` and `runs show` give."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except NotFound as exc:
            name = getattr(args, "run", None)
            if not name or exc.hint or f"run {name!r}" not in exc.message:
                raise
            if f"run {name!r} was collected" in exc.message:  # by gc: no other name was meant
                raise NotFound(exc.message, hint=f"its lineage record stays: dflashops runs show {name}") from None
            with open_invocation(args) as invocation:
                close = invocation.close_run_names(name, getattr(args, "target", None))
            hint = (
                f"did you mean: {', '.join(close)}?"
                if close
                else "`dflashops status` lists the runs of a target, `dflashops runs list` the recorded runs"
            )
            raise NotFound(exc.message, hint=hint) from None

    return run


def exec_words_before_separator(args: argparse.Namespace, verb_words: list[str], extra: list[str]) -> UsageError:
    """`dflashops exec local echo hi`: the command was given without `--` in front of it."""
    if args.all and args.target is not None:  # `exec --all echo hi`: argparse took `echo` for the TARGET
        extra = [args.target, *extra]
    fixed = join_argv(moved_after_separator(verb_words, extra, args.passthrough))
    return UsageError(
        f"exec takes its command after `--` (found `{join_argv(extra)}` before it)",
        hint=f"put the command after --: {fixed}",
    )


def add_all_options(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--all", action="store_true", help=help_text)
    parser.add_argument(
        "--all-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="with --all: seconds before a slow target is reported as timed out (default 60)",
    )


def handle_stop(args: argparse.Namespace) -> int:
    if args.all:
        from dflashops.cli import fanout as fanout_cli  # rich: only --all pays its import

        return fanout_cli.handle_stop_all(args)
    if not args.run:
        raise UsageError("stop needs a RUN (or --all)")
    with open_invocation(args, dry_run=args.dry_run) as invocation:
        stopped = stop_run(
            invocation, args.run, target=args.target, grace=args.grace, save_grace=args.save_grace, now=args.now
        )
        answer = stopped.answer
        if args.dry_run or answer is None:  # None: only planned
            print_plan(invocation)
            return 0
        if answer.joined:
            return report_joined_stop(args.run, answer)
        how = "SIGKILL after the grace period" if answer.escalated else "SIGTERM"
        if answer.now:
            how = "SIGKILL at once (--now: no final checkpoint)"
        if answer.supervisor_cancelled:
            progress(f"{args.run}'s supervisor was stopped: no automatic restart will follow")
        if answer.supervisor_cancelled and not answer.signalled:
            print(f"{args.run} restart-cancelled exit_code={answer.exit_code}")
            return 0
        if answer.before_start:
            progress(f"stopped {args.run} before its job started (it was still launching); it never ran")
        else:
            progress(f"stopped {args.run} by {how} in {answer.seconds}s; exit code {answer.exit_code}")
        if answer.recorded is False:
            progress(
                f"warning: could not write {args.run}'s stop.json (is the target's disk full?); "
                "the run was stopped, but status may call it crashed"
            )
        if answer.waited_for_checkpoint_s:
            progress(
                f"waited {answer.waited_for_checkpoint_s}s past the grace period for its checkpoint to be "
                f"written{' (then SIGKILL: --save-grace ran out)' if answer.escalated else ''}"
            )
        if answer.gpu_released is False:
            progress("warning: the run's GPU memory was not released within the timeout")
        for node in stopped.nodes:
            progress(
                f"  node {node['node']} on {node['target']}: "
                + ("was not running" if node.get("not_running") else f"exit code {node.get('exit_code')}")
            )
        print(f"{args.run} stopped exit_code={answer.exit_code}")
        return 0


def report_joined_stop(run: str, answer: StopAnswer) -> int:
    """A stop that met another stop or restart of the run: it waited for that one instead of signalling again
    (a second SIGTERM would have cost the final checkpoint); say what that one did."""
    joined = answer.joined or {}
    outcome = joined.get("outcome") or {}
    progress(
        f"{run}: a {joined.get('op') or 'stop'} of it by another command (pid {joined.get('pid')}) was already in "
        "progress; waited for it instead of signalling again"
    )
    if outcome.get("name"):
        progress(f"{run} was restarted as {outcome['name']}, which runs on: `dflashops stop {outcome['name']}`")
    if answer.checkpoints:
        progress(f"{run}'s last checkpoint: {answer.checkpoints[-1]}")
    print(f"{run} {answer.state} exit_code={answer.exit_code}")
    return 0


def handle_status(args: argparse.Namespace) -> int:
    """The runs' facts on stdout, after the observer's step (what it did on stderr). May change: see the module
    docstring (`status`)."""
    if args.all:
        from dflashops.cli import fanout as fanout_cli  # rich: only --all pays its import

        return fanout_cli.handle_status_all(args)
    window = not (args.run or args.json or args.all_runs)
    hidden = 0
    with open_invocation(args) as invocation:
        if window:  # the table of every run: those running and those that ended in the last RECENT_S
            runs, hidden = target_status(invocation, args.target, ended_within_s=RECENT_S)
        else:
            runs = run_status(invocation, args.run, target=args.target, unreachable_ok=True)
        # The one step of `status` that acts (ops/runs/observer.py), before the table, which shows a revival.
        for line in observe_runs(invocation, runs).lines:
            progress(line)
        # A run on several targets: every node's line, also when one cannot be reached; the GPUs are those
        # of the first node that answered.
        reached = [entry for entry in runs if entry["state"] != "unreachable"]
        asked = (
            invocation.agent(invocation.inventory.target(reached[0]["target"] if runs else args.target)).ask(
                "gpus", {}, GpusAnswer
            )
            if (args.json or args.run) and (reached or not runs)
            else None
        )
        gpus = [answer_json(gpu) for gpu in asked.gpus] if asked is not None else []  # as --json prints them
    if args.json:
        emit_json({"runs": runs, "gpus": gpus})
    else:
        print_runs(runs, gpus, quiet_when_empty=bool(hidden))
    if hidden:
        progress(
            f"{hidden} run{'s' if hidden != 1 else ''} that ended more than {RECENT_S // 3600} h ago not shown "
            "(--all-runs shows every run, --json gives every run)"
        )
    if args.run and (error := unreachable_error(args.run, runs)):
        raise error  # after every node's line, with the exit status of a target that cannot be reached
    return 0


def print_runs(entries: list[dict[str, Any]], gpus: list[dict[str, Any]], *, quiet_when_empty: bool = False) -> None:
    """The table `watch` shows (cli/run_table.py), its per-run lines, and the GPUs of the target."""
    if not entries:  # before the table's imports: rich costs ~25 ms of a call that prints no table
        if not quiet_when_empty:
            progress("no runs on this target yet")
        return
    from dflashops.cli.run_table import detail_lines, gpu_table, ordered, runs_table
    from dflashops.ops.observe.watch import GpuRow, run_row

    now = time.time()
    rows = [run_row(entry, now) for entry in entries]
    out = output_console()
    out.print(runs_table(rows))
    for row in ordered(rows):
        for line in detail_lines(row):
            out.print(line, markup=False, overflow="ignore", crop=False)
    if gpus:
        target = str(entries[0].get("target", ""))
        keys = ("index", "name", "memory_used_mib", "memory_total_mib", "utilization_pct")
        out.print(gpu_table([GpuRow(target=target, **{k: g[k] for k in keys}) for g in gpus]))


def handle_logs(args: argparse.Namespace) -> int:
    if args.since < 0:
        raise UsageError("--since must be a byte offset >= 0")
    if args.tail is not None and (args.tail < 0 or args.since):
        raise UsageError(
            "-n/--tail takes a number of lines >= 0, and not with --since",
            hint=f"dflashops logs {args.run} -n 20  (the last 20 lines)",
        )
    cursor = LogCursor(offset=args.since, last_lines=args.tail, to_line_start=args.since > 0)
    # May change: nothing. A crashed run seen at the end of `logs -f` is an exit status, not an observation.

    def write(text: str) -> None:
        sys.stdout.write(text if args.raw else highlight_errors(text))
        sys.stdout.flush()

    with open_invocation(args, read_only=True) as invocation:
        if args.node is not None:
            args.target = args.target or node_target(invocation, args.run, args.node)
        try:
            if args.until or args.fail_on:
                wait_for(
                    invocation,
                    args.run,
                    until=args.until,
                    fail_on=args.fail_on,
                    target=args.target,
                    timeout=args.timeout,
                    cursor=cursor,
                    on_text=write,
                    on_notice=progress,
                )
            else:
                for chunk in read_log(
                    invocation,
                    args.run,
                    cursor,
                    target=args.target,
                    follow=args.follow,
                    timeout=args.timeout,
                    on_notice=progress,
                ):
                    write(chunk)
                if args.follow and (failure := ended_badly(invocation, args.run, target=args.target)):
                    raise failure  # followed to the end of a crashed run: scripts see it in the exit status
        except KeyboardInterrupt:  # quietly: the run goes on, and the line says how to follow it again
            progress(follow_again(args.run, cursor.offset, ended=cursor.run_ended, node=args.node))
            return 130
    return 0


def handle_exec(args: argparse.Namespace) -> int:
    if args.all:
        from dflashops.cli import fanout as fanout_cli  # rich: only --all pays its import

        return fanout_cli.handle_exec_all(args)
    if not args.target:
        raise UsageError("exec needs a TARGET (or --all)", hint="dflashops exec local -- nvidia-smi")
    if not args.passthrough:
        raise UsageError("exec needs a command after `--`", hint="dflashops exec local -- nvidia-smi")
    with open_invocation(args, dry_run=args.dry_run) as invocation:
        target = invocation.inventory.target(args.target)
        agent = invocation.agent(target)
        if args.dry_run:
            agent.record(args.passthrough)
            print_plan(invocation)
            return 0
        result = agent.transport.run(args.passthrough, check=False)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.exit_code


def handle_attach(args: argparse.Namespace) -> int:
    from dflashops.ops.runs.attach import attach_argv

    with open_invocation(args, read_only=True) as invocation:
        argv = attach_argv(invocation, args.run, target=args.target, node=args.node)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            "attach needs a terminal (stdin and stdout are not both one)",
            hint=f"`dflashops logs {args.run} -f` follows the run's output without one",
        )
    executable = shutil.which(argv[0])
    if executable is None:
        raise TransportError(f"`{argv[0]}` is not installed here", hint="install it, or use `dflashops logs -f`")
    os.execv(executable, argv)
    return 0  # not reached


def handle_gc(args: argparse.Namespace) -> int:
    for name in args.run:
        validate_name(name, what="run name")
    # Not a dry-run invocation even for --dry-run: the agent's own dry run reads what would go (paths, sizes).
    with open_invocation(args) as invocation:
        target = invocation.inventory.target(args.target)
        request = {"workspace": target.workspace, "keep": args.keep, "runs": args.run, "standby": args.standby}
        answer = invocation.agent(target).ask("gc", {**request, "dry_run": True} if args.dry_run else request, GcAnswer)
        assert answer is not None  # the invocation is no dry run: the call ran
        if not args.dry_run:
            mark_collected(invocation, target.name, answer)
    if args.json:
        emit_json(answer_json(answer))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for item in answer.removed:
        print(f"{verb} {item.kind} {item.name}  {item.path}  {size(item.bytes)} in {item.files} files")
    for folder in answer.retired_standbys:
        print(f"{'would retire' if args.dry_run else 'retired'} standby {folder}")
    total = sum(item.bytes for item in answer.removed)
    runs, releases = len(answer.removed_runs), len(answer.removed_releases)
    summary = f"{runs} run director{'y' if runs == 1 else 'ies'} and {releases} release(s), {size(total)}"
    if args.dry_run:
        progress(f"dry run on {target.name}: {summary} would be deleted; nothing was deleted")
    elif answer.removed or answer.retired_standbys:
        progress(f"gc on {target.name}: deleted {summary}")
    else:
        progress(
            f"gc on {target.name}: nothing to delete (releases kept: the newest {args.keep}, the current one "
            "and those of live runs)"
        )
    return 0


def mark_collected(invocation: Any, target: str, answer: GcAnswer) -> None:
    """The lineage keeps the record of a run whose directory gc deleted, with the state that directory held last
    and marked collected (when, by gc), so the views say where its files went."""
    for item in answer.removed:
        record = invocation.record_of(item.name) if item.kind == "run" else None
        if record is not None and record.target == target:
            final = item.final or {}
            fields = {"exit_code": final.get("exit_code", record.exit_code)}
            if isinstance(final.get("step"), int):
                fields["last_step"] = final["step"]
            collected = {"at": utc_now_iso(), "by": "gc", "target": target, "bytes": item.bytes}
            state = AGENT_STATE_TO_LINEAGE.get(str(final.get("state")), record.state)
            invocation.db.set_state(record.name, state, **fields, extra={"collected": collected})
