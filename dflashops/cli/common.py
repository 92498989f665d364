"""Helpers every verb module shares: opening an Invocation, printing data vs progress, colour rules.

Data goes to stdout, progress and logs to stderr. Colour is used only on a terminal and never when
NO_COLOR is set, and meaning never depends on colour (states are words, errors start with `error:`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, cast

from dflashops.core.errors import DflashopsError
from dflashops.core.inventory import load_inventory
from dflashops.core.shell import join_argv
from dflashops.ops.invocation import Invocation

if TYPE_CHECKING:
    from rich.console import Console


@contextmanager
def open_invocation(
    args: argparse.Namespace, *, dry_run: bool = False, read_only: bool = False
) -> Iterator[Invocation]:
    """The verb's Invocation, closed after it; then what it did on the side (notifications, warnings) on stderr.
    `read_only`: a verb that only reads (logs, watch): the lineage is opened read-only (Invocation.read_only)."""
    invocation = Invocation(load_inventory(getattr(args, "inventory", None)), dry_run=dry_run, read_only=read_only)
    try:
        yield invocation
    finally:
        for notice in invocation.notices:  # notifications sent (or failed) while the verb ran
            progress(notice)
        invocation.close()
        for warning in invocation.warnings:
            progress(f"warning: {warning}")


def show_passthrough(parser: argparse.ArgumentParser, tail: str) -> None:
    """Append `tail` (e.g. `[-- trainer args]`) to the parser's usage line: cli/main.py cuts everything after
    the first `--` off before argparse sees it, so argparse cannot show that part itself. Call it after the
    last add_argument."""
    parser.usage = parser.format_usage().removeprefix("usage: ").rstrip().replace("%", "%%") + " " + tail


def moved_after_separator(verb_words: list[str], extra: list[str], passthrough: list[str]) -> list[str]:
    """The command line `verb_words` with the words argparse did not take (`extra`) moved after `--` (in front
    of what was there already): the fix for a command or trainer arguments typed without `--`."""
    kept = list(verb_words)
    for word in reversed(extra):  # the words argparse did not take, removed from the end
        del kept[len(kept) - 1 - kept[::-1].index(word)]
    return ["dflashops", *kept, "--", *extra, *passthrough]


def follow_again(run: str, offset: int, *, ended: bool = False, node: int | None = None) -> str:
    """What Ctrl-C during a follow (`logs -f`, `deploy --wait`) says: the run keeps going (a follow never stops
    it) and the whole command that follows on from the line start where this one stopped."""
    command = join_argv(
        ["dflashops", "logs", run, "-f", "--since", str(offset), *(["--node", str(node)] if node is not None else [])]
    )
    if ended:
        return f"{run} has ended (`dflashops status {run}` says how); the rest of its log: {command}"
    return f"{run} is still running; follow again: {command}"


def size(count: int) -> str:
    """`2.0 KiB`, `12.6 GiB`: bytes in the largest unit that keeps a number >= 1."""
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_error(error: DflashopsError, prefix: str = "") -> None:
    """The one error format (uv's): `error: <message>`, then `hint: <fix>` when there is one, on stderr (after
    the verb's usage line when the error carries one)."""
    if error.usage:
        progress(error.usage.rstrip())
    progress(f"error: {prefix}{error.message}")
    if error.hint:
        progress(f"hint: {error.hint}")


def emit_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def use_colour(stream: Any = None) -> bool:
    stream = sys.stdout if stream is None else stream
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


class _UnpaddedLines:
    """A text stream that drops the spaces before each line end: rich pads every table cell to its column's
    width, so piped rows would end in up to a line's width of blanks (noise in files, diffs and copies)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.encoding: str = getattr(stream, "encoding", None) or "utf-8"  # rich picks its box characters by it

    def write(self, text: str) -> int:
        self._stream.write(re.sub(r" +(?=\n)", "", text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False


def output_console(stream: Any = None, *, piped_width: int = 200, **options: Any) -> Console:
    """The rich Console for a verb's data on `stream` (stdout by default). On a terminal: its width, colour
    unless NO_COLOR. Piped: no colour, a virtual terminal $COLUMNS or `piped_width` wide (so rows stay one line each
    for grep and awk), and no trailing blanks on a line. `options` go to Console (e.g. soft_wrap)."""
    from rich.console import Console  # rich's import is ~40 ms: only verbs that print tables pay it

    stream = sys.stdout if stream is None else stream
    tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if tty else int(os.environ.get("COLUMNS", "0") or 0) or piped_width
    return Console(
        file=stream if tty else cast("IO[str]", _UnpaddedLines(stream)),
        no_color=not use_colour(stream),
        highlight=False,
        width=width,
        **options,
    )


def highlight_errors(text: str, stream: Any = None) -> str:
    """Tracebacks and error lines in bold red on a colour terminal; unchanged otherwise (the words
    `Traceback` / `Error` already carry the meaning)."""
    if not use_colour(stream):
        return text
    out = []
    for line in text.splitlines(keepends=True):
        if "Traceback (most recent call last)" in line or "Error" in line or line.startswith("  File "):
            out.append(f"\x1b[1;31m{line.rstrip(chr(10))}\x1b[0m" + ("\n" if line.endswith("\n") else ""))
        else:
            out.append(line)
    return "".join(out)


def print_plan(invocation: Invocation) -> None:
    """The dry-run plan: the exact commands that would run, one per line, on stdout."""
    for line in invocation.plan:
        print(line)
