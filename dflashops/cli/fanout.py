"""`status --all`, `stop --all`, `exec --all`: one verb over every target at once (dflashops.ops.fleet.fanout).

Output: a rich table on stdout (colour only on a terminal, none with NO_COLOR; every state is a word),
or `--json`. Exit code 0 when every target answered, 1 when any failed or timed out: the failed rows
carry the error and hint, so one dead host is visible without hiding the others.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashops.cli.common import emit_json, output_console, progress
from dflashops.core.errors import UsageError
from dflashops.core.inventory import load_inventory
from dflashops.ops.fleet.fanout import FanoutResult, exec_all, status_all, stop_all


def console() -> Console:
    return output_console(piped_width=160, soft_wrap=True)


def failed_row(table: Table, result: FanoutResult[Any], columns: int) -> None:
    what = "timed out" if result.timed_out else "error"
    detail = result.error or ""
    if result.hint:
        detail += f" (hint: {result.hint})"
    table.add_row(result.target, what, detail, *([""] * (columns - 3)))


def handle_status_all(args: argparse.Namespace) -> int:
    if args.run or args.target:
        raise UsageError("--all reports every run of every target; drop RUN/--target, or drop --all")
    told: list[str] = []  # what the observer did on each target (a supervisor started again, a notification queued)
    results = status_all(load_inventory(getattr(args, "inventory", None)), timeout=args.all_timeout, told=told)
    for line in told:
        progress(line)
    if args.json:
        emit_json(
            {
                "targets": [
                    {
                        "target": r.target,
                        "ok": r.ok,
                        "error": r.error,
                        "hint": r.hint,
                        "timed_out": r.timed_out,
                        "seconds": round(r.duration_s, 2),
                        "runs": r.value or [],
                    }
                    for r in results
                ]
            }
        )
    else:
        # The one table of runs (cli/run_table.py, as `status` and `watch`); a target that failed gets a row
        # of its own (state `unreachable` or `timed out`) and its error below the table.
        from dflashops.cli.run_table import detail_lines, ordered, runs_table
        from dflashops.ops.observe.watch import RunRow, run_row

        now = time.time()
        rows: list[RunRow] = []
        for result in results:
            if not result.ok:
                error = (result.error or "") + (f" (hint: {result.hint})" if result.hint else "")
                state = "timed out" if result.timed_out else "unreachable"
                rows.append(RunRow(name="-", target=result.target, state=state, error_line=error))
            for entry in result.value or []:
                rows.append(run_row({**entry, "target": result.target}, now))
        out = console()
        out.print(runs_table(rows, title="runs on every target"))
        for row in ordered(rows):
            for line in detail_lines(row):
                out.print(line if row.name != "-" else line.replace("- error:", f"{row.target}:", 1), markup=False)
        for result in results:
            if result.ok and not result.value:
                out.print(f"{result.target}: no runs", markup=False)
    return 0 if all(r.ok for r in results) else 1


def handle_stop_all(args: argparse.Namespace) -> int:
    if args.run or args.target:
        raise UsageError("--all stops every running run of every target; drop RUN/--target, or drop --all")
    results = stop_all(
        load_inventory(getattr(args, "inventory", None)),
        grace=args.grace,
        save_grace=args.save_grace,
        dry_run=args.dry_run,
        timeout=args.grace + args.save_grace + args.all_timeout,
    )
    table = Table(title="stop --all" + (" (dry run: nothing stopped)" if args.dry_run else ""), title_justify="left")
    for column in ("target", "result", "runs"):
        table.add_column(column)
    for result in results:
        if result.ok:
            table.add_row(result.target, "ok", ", ".join(result.value or []) or "(none running)")
        else:
            failed_row(table, result, 3)
    console().print(table)
    return 0 if all(r.ok for r in results) else 1


def handle_exec_all(args: argparse.Namespace) -> int:
    if args.target and not args.passthrough:
        raise UsageError(
            "exec takes its command after `--`", hint=f"put the command after --: dflashops exec --all -- {args.target}"
        )
    if args.target:
        raise UsageError("--all runs on every target; drop TARGET, or drop --all")
    if not args.passthrough:
        raise UsageError("exec needs a command after `--`", hint="dflashops exec --all -- nvidia-smi")
    if args.dry_run:
        inventory = load_inventory(getattr(args, "inventory", None))
        from dflashops.core.shell import join_argv

        for name in inventory.targets:
            print(f"[{name}] {join_argv(args.passthrough)}")
        return 0
    results = exec_all(load_inventory(getattr(args, "inventory", None)), args.passthrough, timeout=args.all_timeout)
    worst = 0
    for result in results:
        if not result.ok:
            progress(f"[{result.target}] error: {result.error}" + (f" (hint: {result.hint})" if result.hint else ""))
            worst = max(worst, 1)
            continue
        outcome = result.value
        assert outcome is not None  # an ok result carries the command's Result
        for line in outcome.stdout.splitlines():
            print(f"[{result.target}] {line}")
        for line in outcome.stderr.splitlines():
            progress(f"[{result.target}] {line}")
        if outcome.exit_code:
            progress(f"[{result.target}] exit code {outcome.exit_code}")
            worst = max(worst, 1)
    return worst
