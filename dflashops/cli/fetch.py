"""`dflashops fetch RUN [--checkpoint latest|STEP] [--export [--format zlab|speculators [--target-model DIR]
[--verifier NAME]]] [--logs] [--to DIR] [--json]`.

A rich progress bar with the rate on stderr (plain lines when stderr is not a terminal); on stdout the
destination folder, or with --json the whole outcome (files, how each came: fetched / resumed / unchanged,
bytes sent, rate).
May change: the destination folder here (and with --export the run's export on the target); no observer step.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflashops.cli.common import emit_json, open_invocation, print_plan, progress, size
from dflashops.cli.control import with_run_hint
from dflashops.core.errors import UsageError
from dflashops.ops.fetch.fetch import EXPORT_FORMATS, FetchRequest, Progress, fetch


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fetch",
        help="bring a run's checkpoint, export or logs here: resumable, sha256-verified, atomic",
        description="Copy RUN's latest (or --checkpoint STEP) checkpoint, or with --export the public DFlash export "
        "of it (made on the target first), and/or its logs (--logs) into --to DIR, with run.json, "
        "status.json and metrics.jsonl. Files are verified against sha256 sums computed on the target; "
        "a cut connection continues where it stopped (also in a later fetch); a partial file is "
        "never visible under its final name.",
    )
    p.add_argument("run", metavar="RUN", help="the run to fetch from")
    p.add_argument("--target", help="target (default: RUN's recorded target, or the default target)")
    p.add_argument("--checkpoint", metavar="latest|STEP", help="which checkpoint: latest (default) or a step number")
    p.add_argument(
        "--export",
        action="store_true",
        help="export that checkpoint on the target (python -m trainer export) and fetch the export",
    )
    p.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        help="with --export: zlab, the public DFlash format, into export/step_N/; or speculators, vLLM speculators' "
        "form with the target's embedding, LM head and final norm, into export/step_N-speculators/ (default: zlab)",
    )
    p.add_argument(
        "--target-model",
        metavar="DIR",
        help="with --format speculators: the target's Hugging Face directory ON THE TARGET (default: the one the "
        "run's checkpoint records; a tiny-preset run's target is rebuilt from its config)",
    )
    p.add_argument(
        "--verifier",
        metavar="NAME",
        help="with --format speculators: the target's name written into the export, e.g. Qwen/Qwen3-8B, so that "
        "serving machines find it (default: the target directory)",
    )
    p.add_argument("--logs", action="store_true", help="fetch train.log too (alone: logs and metadata only)")
    p.add_argument("--to", metavar="DIR", type=Path, help="destination folder (default: ./fetched/RUN)")
    p.add_argument(
        "--retries",
        type=int,
        default=8,
        metavar="N",
        help="times to continue a file after a cut connection within this call (default 8)",
    )
    p.add_argument("--json", action="store_true", help="the outcome as JSON on stdout")
    p.add_argument(
        "--dry-run", action="store_true", help="show what would be exported and fetched; change nothing here or there"
    )
    p.set_defaults(func=with_run_hint(handle_fetch))


@contextmanager
def progress_bar(quiet: bool) -> Iterator[Progress]:
    """rich's bar (bytes, rate, ETA) on a terminal; on a pipe, one line per note (no carriage returns)."""
    if quiet or not sys.stderr.isatty():
        yield Progress(note=progress)
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.progress import Progress as Bar

    console = Console(stderr=True, no_color="NO_COLOR" in os.environ)
    with Bar(
        TextColumn("fetch"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("fetch", total=None)
        yield Progress(
            begin=lambda total, done: bar.update(task, total=total, completed=done),
            advance=lambda n: bar.advance(task, n),
            note=lambda text: bar.console.print(text),
        )


def transfer(sent: int, seconds: float, total: float | None = None) -> str:
    """`1,048,576 bytes sent in 0.3 s, 3.3 MiB/s`: the rate of the transfer alone (`seconds`; the whole call,
    with an export, is `total`), in a unit that keeps its digits (a 1 MB fetch after an export said
    `0 MiB/s`), or `nothing sent` when every file was here already."""
    if sent == 0:
        return "nothing sent"
    rate = f", {size(round(sent / seconds))}/s" if seconds > 0 else ""
    whole = f" ({total:.1f} s in all, the export included)" if total is not None else ""
    return f"{sent:,} bytes sent in {seconds:.1f} s{whole}{rate}"


def handle_fetch(args: argparse.Namespace) -> int:
    if args.retries < 0:
        raise UsageError("--retries must be >= 0", hint="--retries 8")
    if args.format is not None and not args.export:
        raise UsageError(
            "--format chooses the export's format: it needs --export", hint="--export --format speculators"
        )
    if (args.target_model or args.verifier) and args.format != "speculators":
        raise UsageError(
            "--target-model and --verifier apply to the speculators export only",
            hint="--export --format speculators --target-model DIR",
        )
    request = FetchRequest(
        run=args.run,
        target=args.target,
        checkpoint=args.checkpoint,
        export=args.export,
        export_format=args.format or "zlab",
        target_model=args.target_model,
        verifier=args.verifier,
        logs=args.logs,
        to=args.to,
        retries=args.retries,
    )
    with open_invocation(args, dry_run=args.dry_run) as invocation, progress_bar(args.dry_run) as sink:
        outcome = fetch(invocation, request, sink)
        if args.dry_run:
            print_plan(invocation)
            for item in outcome.files:
                print(f"would fetch {item.path} ({item.size:,} bytes, sha256 {item.sha256[:12]}) into {outcome.to}")
            return 0
    sent = outcome.to_dict()
    kinds = {how: sum(f.how == how for f in outcome.files) for how in ("fetched", "resumed", "unchanged")}
    moved = transfer(sent["bytes_sent"], outcome.transfer_seconds, outcome.seconds if args.export else None)
    progress(
        f"{args.run}: {len(outcome.files)} file(s) in {outcome.to} ({kinds['fetched']} fetched, "
        f"{kinds['resumed']} resumed, {kinds['unchanged']} unchanged; {moved}); every file matches its sha256"
    )
    if args.json:
        emit_json(sent)
    else:
        print(outcome.to)
    return 0
