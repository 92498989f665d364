"""`deploy` and `restart`: launch a run (optionally waiting on its log), or relaunch one as its child.

May change: the target's releases, the run (restart: the old one stopped), the lineage (the new record), the
supervisor and notifications; the start wait and `--wait` hand what they read to the observer
(ops/runs/observer.py), which may also start a dead supervisor again and update the record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from dflashops.cli.common import (
    follow_again,
    highlight_errors,
    moved_after_separator,
    open_invocation,
    print_plan,
    progress,
    show_passthrough,
    size,
)
from dflashops.core.errors import DflashopsError, LaunchInterrupted, NotFound, UsageError
from dflashops.core.shell import join_argv
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import DEFAULT_FAIL_ON, LogCursor, run_status, wait_for
from dflashops.ops.runs.deploy import deploy
from dflashops.ops.runs.launch import LAUNCHERS, DeployOutcome, DeployRequest
from dflashops.ops.runs.restart import RestartRequest, restart
from dflashops.ops.runs.start_wait import wait_started


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "deploy",
        help="sync the code and launch a run",
        description="Sync the code to TARGET, check that it can start there (the pre-flight: it compiles, the "
        "trainer imports, its arguments validate; another job runs its profile's `check:` command), write run.json, launch the profile's command. Arguments after "
        "`--` replace the profile's value of the same option, or are appended.",
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="target from the inventory (default: the only one, or `local`); a group, or targets "
        "separated by commas (ct200,ct201), runs one job on several (node 0 first)",
    )
    p.add_argument("--profile", default="tiny", help="run profile from the inventory (default: tiny)")
    p.add_argument("--name", help="run name, or + for the next name after --parent (default: PROFILE-TIME)")
    p.add_argument("--parent", help="the run this one derives from (recorded in the lineage)")
    add_launch_options(p)
    show_passthrough(p, "[-- trainer args]")
    p.set_defaults(func=handle_deploy, misplaced_words=trainer_args_before_separator, verb_usage=p.format_usage)

    r = subparsers.add_parser(
        "restart",
        help="stop a run and relaunch it as a new child run",
        description="Sync, check that the new code can start (the pre-flight: it compiles, and for a trainer job "
        "the trainer imports and its arguments and resume checkpoint validate; any other job runs its profile's "
        "`check:` command; a failure leaves RUN running; a job with no `check:` cannot be checked, so a RUN still "
        "running is stopped for it only with --unchecked), stop RUN cleanly, relaunch as a new run whose "
        "parent is RUN. Arguments after `--` are merged over RUN's own extra arguments option by option (a value "
        "given here replaces the same option); --reset-args starts from the profile's instead.",
    )
    r.add_argument("run", metavar="RUN", help="the run to restart")
    r.add_argument("--name", default="+", help="name of the new run (default: + = next name after RUN)")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--fresh", action="store_true", help="start from scratch (default)")
    mode.add_argument(
        "--resume",
        action="store_true",
        help="start from RUN's latest checkpoint (none of its own: the one RUN started from)",
    )
    r.add_argument(
        "--checkpoint",
        metavar="STEP|PATH",
        help="with --resume: this checkpoint of RUN or of one of its ancestors instead of the latest",
    )
    r.add_argument(
        "--reset-args",
        action="store_true",
        help="drop RUN's extra arguments: start from the profile's (and what follows `--`)",
    )
    r.add_argument(
        "--unchecked",
        action="store_true",
        help="stop RUN even though its job cannot be checked first (not the trainer, and its profile has no "
        "`check:`); without it such a restart of a running RUN is refused with nothing stopped",
    )
    r.add_argument("--grace", type=float, default=60.0, help="seconds between SIGTERM and SIGKILL (default 60)")
    r.add_argument(
        "--wait-exit",
        action="store_true",
        help="with --resume: start the new run only after RUN has exited (default: as soon as RUN's "
        "trainer has freed its GPUs and is writing its final checkpoint, which the new run "
        "waits for before reading it)",
    )
    add_launch_options(r, launcher_default=None)
    show_passthrough(r, "[-- trainer args]")
    r.set_defaults(func=handle_restart, misplaced_words=trainer_args_before_separator, verb_usage=r.format_usage)


def trainer_args_before_separator(args: argparse.Namespace, verb_words: list[str], extra: list[str]) -> UsageError:
    """`dflashops deploy --profile tiny --max-steps 10`: trainer arguments given without `--` in front of them.
    The error names them, the hint is the same command with them after `--`, and the verb's usage comes first
    (argparse's own order), exit 2."""
    extra = list(extra)
    target = getattr(args, "target", None)
    if target is not None and target in verb_words:  # `--max-steps 10`: argparse took `10` for the TARGET
        before = verb_words[verb_words.index(target) - 1] if verb_words.index(target) else ""
        if before in extra and before.startswith("-") and "=" not in before:
            extra.insert(extra.index(before) + 1, target)
    error = UsageError(
        f"unrecognized arguments: {join_argv(extra)}",
        hint=f"trainer arguments go after `--`: {join_argv(moved_after_separator(verb_words, extra, args.passthrough))}",
    )
    error.usage = args.verb_usage()
    return error


def add_launch_options(p: argparse.ArgumentParser, launcher_default: str | None = "tmux") -> None:
    p.add_argument("--note", default="", help="the hypothesis this run tests (recorded in the lineage)")
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=launcher_default,
        help="tmux session or setsid/nohup (default: tmux; restart: the parent's)",
    )
    p.add_argument(
        "--clear-cache",
        action="store_true",
        help="remove the target's compile caches first (shared by every code version): compile cold",
    )
    p.add_argument(
        "--skip-preflight",
        action="store_true",
        help="launch without first checking that the new code and arguments can start in the target",
    )
    p.add_argument(
        "--wait",
        metavar="REGEX",
        help="follow the log until REGEX matches (exit 0), instead of waiting for the run's start",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="return as soon as the run is launched (default: wait until it has passed its start: the "
        "profile's started_when: the trainer's first step, after its resume loaded; a crash there is an error)",
    )
    p.add_argument(
        "--fail-on",
        metavar="REGEX",
        default=DEFAULT_FAIL_ON,
        help="while waiting, fail when REGEX appears (default: Traceback)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for --wait or for the start (default 600)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="on stdout, one JSON object per phase as it starts (the lines stderr shows), the last one the start",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands that would run; change nothing")


class Phases:
    """Says each phase of a deploy or restart as it starts: a line on stderr (after `[ 12.3s]`, the time since
    the command began, on a terminal), and with --json the event as one JSON line on stdout. The agent's phases
    (pre-flight, stopping, stopped, launching) arrive through Invocation.on_phase while its one call runs."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.began = time.monotonic()
        self.clock = sys.stderr.isatty()
        self.seen: set[str] = set()

    def __call__(self, event: dict[str, Any]) -> None:
        phase = str(event.get("phase"))
        self.seen.add(phase)
        elapsed = time.monotonic() - self.began
        if self.as_json:
            print(json.dumps({**event, "elapsed_s": round(elapsed, 1)}, sort_keys=True, default=str), flush=True)
        line = phase_line(event)
        if line:
            progress(f"[{elapsed:5.1f}s] {line}" if self.clock else line)


def phase_line(event: dict[str, Any]) -> str | None:
    """The human line of one phase event (None: a phase with nothing to say)."""
    phase = event.get("phase")
    if phase == "sync":
        if event.get("files") is None:
            return f"syncing the code to {event.get('target')}"
        files = int(event["files"])
        return f"syncing {files} changed file{'s' if files != 1 else ''} to {event.get('target')} (code {event.get('code')})"
    if phase == "preflight":
        if event.get("checks") == "compile":
            return "pre-flight: compiling the new code's Python files"
        if event.get("checks") == "check":
            return f"check: running `{event.get('command')}`"
        resume = f", and its checkpoint {event['resume']}" if event.get("resume") else ""
        return f"pre-flight: importing the trainer, checking its arguments{resume}"
    if phase == "preflight_done":
        return preflight_line(
            {"summary": event.get("summary"), "in": event.get("where"), "seconds": event.get("seconds")}
        )
    if phase == "stopping":
        then = "; the new run starts once its devices are free" if event.get("handover") else ""
        return f"stopping {event.get('run')}: SIGTERM, then its final checkpoint{then}"
    if phase == "stopped":
        if event.get("handover"):
            return (
                f"{event.get('run')} stopped training and is writing its final checkpoint {event['handover']}; "
                "the new run starts and waits for it"
            )
        if event.get("was_running"):
            return f"{event.get('run')} stopped (exit code {event.get('exit_code')})"
        return f"{event.get('run')} was not running"
    if phase == "launching":
        return f"launching {event.get('name')}" + (f", resuming from {event['resume']}" if event.get("resume") else "")
    if phase == "waiting":
        return f"waiting for {event.get('name')}'s {str(event.get('mark')).replace('_', ' ')}"
    return None


def report(invocation: Invocation, outcome: DeployOutcome, args: argparse.Namespace) -> int:
    said = invocation.on_phase.seen if isinstance(invocation.on_phase, Phases) else set()
    for node in outcome.nodes or [outcome]:
        if node.preflight and "preflight_done" not in said:
            progress(preflight_line(node.preflight))
        if node.cache_cleared:
            gone = node.cache_cleared
            progress(
                f"cleared the compile caches of {node.target}: {size(gone.bytes)} in "
                f"{gone.files} files ({', '.join(gone.removed) or 'there were none'})"
            )
    if args.dry_run:
        print_plan(invocation)
        return 0
    for rank, node in enumerate(outcome.nodes or [outcome]):
        where = f"node {rank} of {len(outcome.nodes)} on {node.target}" if outcome.nodes else node.target
        progress(
            f"launched {node.name} on {where} (code {node.code_hash}, {node.uploaded} files uploaded, "
            f"pgid {node.pgid}{', standby interpreter' if node.standby else ''}) in {node.run_dir}"
        )
    if outcome.supervisor is not None:
        if outcome.supervisor.get("ok"):
            progress(
                f"supervised in the target by pid {outcome.supervisor.get('pid')} (on_failure/stall of the "
                f"profile; log: {outcome.supervisor.get('log')})"
            )
        else:
            progress(
                f"warning: {outcome.supervisor.get('error')}"
                + (f"\nhint: {outcome.supervisor['hint']}" if outcome.supervisor.get("hint") else "")
            )
    if not args.json:
        print(outcome.name)
    if not args.wait and not args.detach:
        return report_start(invocation, outcome.name, args.timeout)
    invocation.phase("launched", name=outcome.name, run_dir=outcome.run_dir)
    if args.wait:
        cursor = LogCursor()
        try:
            line = wait_for(
                invocation,
                outcome.name,
                until=args.wait,
                fail_on=args.fail_on,
                timeout=args.timeout,
                cursor=cursor,
                on_text=lambda text: sys.stderr.write(highlight_errors(text, sys.stderr)),
                observe=True,
            )
        except KeyboardInterrupt:  # quietly: the run was launched and goes on; say how to follow it again
            sys.stderr.flush()
            progress(follow_again(outcome.name, cursor.offset, ended=cursor.run_ended))
            return 130
        progress(f"matched: {line.strip()}")
    return 0


def report_start(invocation: Invocation, name: str, timeout: float) -> int:
    """Wait until `name` has passed its start (ops/runs/start_wait.py) and say how on stderr, with the
    checkpoint it resumed from (the one the agent passed it: a hand-over's final one); a crash in that window
    raises RunFailed (its end, the last log lines, hint `dflashops logs RUN`)."""
    record = invocation.record_of(name)
    profiles = invocation.inventory.profiles
    profile = profiles.get(record.profile) if record is not None and record.profile else None
    started_when = profile.started_when if profile else "settle"
    resumed = (record.extra.get("resumed_from") if record is not None else None) or None
    invocation.phase("waiting", name=name, mark="start" if started_when == "settle" else started_when)
    try:
        started = wait_started(invocation, name, started_when=started_when, timeout=timeout)
    except KeyboardInterrupt:  # quietly: the run was launched and goes on
        progress(f"{name} goes on; `dflashops watch {name}` shows how it does")
        return 130
    invocation.phase("started", name=name, how=started.how, ended=started.ended, resumed_from=resumed)
    if started.ended:
        progress(f"{name} {started.how}, inside its start window ({started.seconds:.1f} s)")
    else:
        where = f"; resumed from {resumed}" if resumed else ""
        progress(f"{name} passed its start: {started.how}{where} ({started.seconds:.1f} s)")
    return 0


def preflight_line(verdict: dict) -> str:
    """`pre-flight: ok: 200 optimizer steps (a standby interpreter, 0.8 s)`, or why it could not run yet."""
    if verdict.get("skipped"):
        return f"pre-flight: not run in the dry run: {verdict['skipped']}"
    what = verdict.get("summary") or (
        "every Python file compiles; the job is not `python -m trainer train` and its profile has no `check:`, so "
        "whether it starts (its "
        "arguments, its imports) is not checked"
    )
    where = f"{verdict['in']}, " if verdict.get("in") else ""
    return f"pre-flight: {what} ({where}{verdict.get('seconds', 0):.1f} s)"


def check_wait_options(args: argparse.Namespace) -> None:
    if args.detach and args.wait:
        raise UsageError("--detach returns at once; --wait REGEX follows the log: give one of them")


def interrupted_before_launch(invocation: Invocation, name: str, target: str | None) -> int:
    """Ctrl-C before `deploy` answered (syncing, the pre-flight, the launch): say whether `name` was launched,
    as its target tells (a remote agent may finish a launch it had begun); exit 130 either way."""
    try:
        launched = bool(run_status(invocation, name, target=target))
    except NotFound:
        launched = False
    except (DflashopsError, KeyboardInterrupt):
        progress(f"interrupted: whether {name} was launched is not known; `dflashops status {name}` tells")
        return 130
    if launched:
        progress(f"interrupted after {name} was launched: it runs on; `dflashops stop {name}` stops it")
    else:
        nothing = f"nothing was launched ({name} does not exist there)"
        progress(f"interrupted before the launch: {nothing}; the same command starts it again")
    return 130


def handle_deploy(args: argparse.Namespace) -> int:
    check_wait_options(args)
    with open_invocation(args, dry_run=args.dry_run) as invocation:
        invocation.on_phase = Phases(args.json)
        try:
            outcome = deploy_request(invocation, args)
        except LaunchInterrupted as interrupt:
            return interrupted_before_launch(invocation, interrupt.name, args.target)
        return report(invocation, outcome, args)


def deploy_request(invocation: Invocation, args: argparse.Namespace) -> DeployOutcome:
    """`deploy` of what the command line asks for."""
    return deploy(
        invocation,
        DeployRequest(
            target=args.target,
            profile=args.profile,
            name=args.name,
            parent=args.parent,
            note=args.note,
            launcher=args.launcher,
            clear_cache=args.clear_cache,
            extra_args=args.passthrough,
            preflight=not args.skip_preflight,
        ),
    )


def handle_restart(args: argparse.Namespace) -> int:
    check_wait_options(args)
    if args.checkpoint is not None:
        if args.fresh:
            raise UsageError("--checkpoint names the checkpoint to resume from; --fresh starts from none")
        args.resume = True
    with open_invocation(args, dry_run=args.dry_run) as invocation:
        phases = invocation.on_phase = Phases(args.json)
        outcome = restart(
            invocation,
            RestartRequest(
                run=args.run,
                name=args.name,
                note=args.note,
                resume=args.resume,
                clear_cache=args.clear_cache,
                launcher=args.launcher,
                extra_args=args.passthrough or None,
                reset_args=args.reset_args,
                checkpoint=args.checkpoint,
                preflight=not args.skip_preflight,
                unchecked=args.unchecked,
                grace=args.grace,
                handover=not args.wait_exit,
            ),
        )
        if not args.dry_run and "stopped" not in phases.seen:  # the agent said none of its phases (a stale one)
            how = f"stopped (exit code {outcome.old_exit_code})" if outcome.stopped else "was not running"
            if outcome.handover:  # GPUs only for a run that had some: a CPU run's trainer freed none
                record = invocation.record_of(args.run)
                freed = "freed its GPUs" if record is not None and record.gpus else "stopped training"
                how = f"stopping: its trainer {freed} and is writing its final checkpoint"
            progress(f"{args.run} {how}" + (f"; resuming from {outcome.checkpoint}" if outcome.checkpoint else ""))
        return report(invocation, outcome.deployed, args)
