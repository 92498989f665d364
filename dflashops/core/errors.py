"""Typed errors. Every layer raises these; only `dflashops.cli` turns them into output and exit codes.

An error carries a one-line message, an optional one-line hint (a fix the user can apply) and the exit
code the CLI should use. The CLI prints `error: <message>` and, when present, `hint: <hint>` on stderr.
"""

from __future__ import annotations

import shlex  # not dflashops.core.shell, which imports this module: the same quoting, no import circle
from collections.abc import Sequence
from typing import Protocol


class CommandOutcome(Protocol):
    """What `CommandFailed` reads from a finished command: `dflashops.transport.base.Result` fits it.

    A Protocol rather than an import of Result, because transport.base imports this module: errors stays the
    bottom of the house and imports nothing of dflashops.
    """

    @property
    def argv(self) -> Sequence[str]: ...

    @property
    def exit_code(self) -> int: ...

    @property
    def stdout(self) -> str: ...

    @property
    def stderr(self) -> str: ...

    @property
    def target(self) -> str: ...


class DflashopsError(Exception):
    """Base class: a failure the user can understand and act on (never a stack trace)."""

    exit_code: int = 1
    usage: str | None = None  # a verb's usage line, printed before the error (argparse's order) when set

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(DflashopsError):
    """Bad arguments or names: refused before anything runs."""

    exit_code = 2


class MissingDependency(DflashopsError):
    """An optional package a verb needs is not installed (the hint names the extra that brings it)."""

    exit_code = 2


class InventoryError(DflashopsError):
    """inventory.yaml is missing, malformed, or names something that does not exist."""

    exit_code = 2


class NotFound(DflashopsError):
    """A run, target, profile or file that the user named does not exist."""

    exit_code = 3


class Conflict(DflashopsError):
    """The requested change would overwrite or collide with existing state (e.g. a run name in use)."""

    exit_code = 4


class LocalDiskFull(DflashopsError):
    """A file this machine was writing (a fetch) met a full disk (ENOSPC, or the user's quota)."""

    exit_code = 1


class TransportError(DflashopsError):
    """The target could not be reached or the channel broke (ssh down, container stopped, ...)."""

    exit_code = 5


class CommandFailed(DflashopsError):
    """A command on the target exited non-zero. Carries the Result (a `CommandOutcome`) so callers can inspect it."""

    exit_code = 6

    def __init__(self, result: CommandOutcome, *, hint: str | None = None, tail_lines: int = 10) -> None:
        stderr_tail = "\n".join(result.stderr.rstrip().splitlines()[-tail_lines:])
        message = (
            f"command failed with exit code {result.exit_code} on {result.target}: {shlex.join(map(str, result.argv))}"
        )
        if stderr_tail:
            message += "\n" + "\n".join("  | " + line for line in stderr_tail.splitlines())
        super().__init__(message, hint=hint)
        self.result = result


class AgentError(DflashopsError):
    """The agent ran but reported `{"ok": false, ...}` or printed something that is not one JSON line."""

    exit_code = 6


class RunFailed(DflashopsError):
    """A launched run crashed, or a `--fail-on` pattern appeared while waiting on it."""

    exit_code = 7


class WaitTimeout(DflashopsError):
    """A `--wait`/`--until` condition was not met within its timeout."""

    exit_code = 8


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C while `deploy` was syncing, checking (the pre-flight) or launching run `name`: its claimed lineage
    name is released by then. Still a KeyboardInterrupt (every handler of one sees it); the CLI asks the target
    whether the run was launched before it says what happened (a remote agent may finish a launch it had begun)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
