"""`dflashops play PLAYBOOK [--target T] [--set key=value ...] [--check] [--json]`.

Progress (one line per step as it ends) and the final per-step report table go to stderr; data goes to
stdout: with --json the whole report, otherwise the tables that `collect` steps filled and, with --check,
the exact commands each step would run (`# [N] kind: label` headers, then one command per line).
Exit code: 0 when the playbook completed (failures under `on_failure: continue` included), else the
exit code of the error that stopped it (a refused playbook exits 2 before any step runs).
May change: what its steps do; its `wait` and `assert` steps on a run hand what they read to the observer
(ops/runs/observer.py), as `status` does. With --check: nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from dflashops.cli.common import emit_json, open_invocation, output_console, print_error, progress
from dflashops.playbook import load_playbook, parse_set
from dflashops.playbook.runner import PlayReport, StepReport, run_playbook


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "play",
        help="run a playbook: ordered dflashops steps from a YAML file",
        description="Run the steps of PLAYBOOK in order and report each one "
        "(ok / changed / failed / skipped) with its duration. Step kinds: stop, sync, "
        "clear-cache, deploy, restart, wait (log REGEX or metric condition, "
        "with a timeout), assert, exec, collect, loop, include; see "
        "dflashops/playbook/ and playbooks/*.yaml.",
    )
    p.add_argument("playbook", help="path to a playbook YAML file (see playbooks/)")
    p.add_argument("--target", help="target for steps that name none (also the {{target}} variable)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a playbook variable (value read as YAML; repeatable)",
    )
    p.add_argument(
        "--check", action="store_true", help="dry run: print the exact commands each step would run; run none of them"
    )
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.set_defaults(func=handle_play)


def _console(stream: Any) -> Console:
    return output_console(stream, piped_width=160)


def _line(entry: StepReport) -> str:
    # The status is a word in a fixed-width column: meaning never depends on colour.
    return f"{entry.status:<9} [{entry.index}] {entry.kind}: {entry.label} ({entry.seconds:.1f}s) {entry.detail}"


def report_table(report: PlayReport) -> Table:
    table = Table(title=f"{'check of ' if report.check else ''}{report.playbook}", title_justify="left")
    for column in ("#", "step", "kind", "status", "seconds", "detail"):
        table.add_column(column, overflow="fold", justify="right" if column == "seconds" else "left")
    for entry in report.steps:
        table.add_row(entry.index, entry.label, entry.kind, entry.status, f"{entry.seconds:.1f}", entry.detail)
    counts: dict[str, int] = {}
    for entry in report.steps:
        counts[entry.status] = counts.get(entry.status, 0) + 1
    table.caption = ", ".join(f"{n} {status}" for status, n in counts.items())
    return table


def data_table(name: str, rows: list[dict[str, Any]]) -> Table:
    columns = list(dict.fromkeys(key for row in rows for key in row)) or ["run"]
    table = Table(title=name, title_justify="left")
    for column in columns:
        table.add_column(column, justify="left" if column in ("run", "state") else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(column)) for column in columns))
    return table


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def handle_play(args: argparse.Namespace) -> int:
    overrides = parse_set(args.overrides)
    if "target" in overrides and args.target is None:
        args.target = str(overrides.pop("target"))
    playbook = load_playbook(args.playbook)  # PlaybookError (exit 2) before any invocation is opened
    playbook.bind(overrides)
    with open_invocation(args, dry_run=args.check) as invocation:
        report = run_playbook(
            invocation,
            playbook,
            overrides,
            target=args.target,
            check=args.check,
            say=progress if os.environ.get("DFLASHOPS_VERBOSE") else lambda text: None,
            on_step=lambda entry: progress(_line(entry)),
        )
    err = _console(sys.stderr)
    err.print(report_table(report))
    if args.json:
        emit_json(report.to_dict())
    else:
        out = _console(sys.stdout)
        if args.check:
            for entry in report.steps:
                print(f"# [{entry.index}] {entry.kind}: {entry.label}")
                for command in entry.commands:
                    print(command)
                if not entry.commands:
                    print(f"#   nothing to run ({entry.detail})")
        for name, rows in report.tables.items():
            if rows:  # a check run fills no rows
                out.print(data_table(name, rows))
    if report.error is not None:
        print_error(report.error, prefix="playbook stopped: ")
    return report.exit_code
