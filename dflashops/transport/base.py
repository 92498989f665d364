"""The Transport seam: the only way dflashops runs anything on a target.

A Transport runs an argv list (never a shell string: quoting happens once, in `dflashops.core.shell`, and only
when a layer below needs a string) and returns a `Result`. Implementations: `local` (subprocess), `ssh`
(Fabric/paramiko), `pct` (wraps another transport with `pct exec CTID -- ...`). Tests replace this seam
and nothing else.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from dflashops.core.errors import CommandFailed

Stdin = bytes | IO[bytes] | None
StderrSink = Callable[[bytes], None]  # gets a command's stderr as it arrives (run's `on_stderr`)


@dataclass(frozen=True)
class Result:
    """What one command did: its argv, exit code, decoded output and wall time."""

    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    target: str = "local"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class Transport(abc.ABC):
    """Runs argv lists on one target. One instance per CLI invocation; connections are reused."""

    name: str = "local"
    default_env: Mapping[str, str] = field(default_factory=dict)

    @abc.abstractmethod
    def _run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
    ) -> tuple[int, bytes, bytes]:
        """Run argv to completion; return (exit code, stdout bytes, stderr bytes)."""

    def _run_watched(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink,
    ) -> tuple[int, bytes, bytes]:
        """`_run`, with stderr also handed to `on_stderr` as it arrives (a long agent call's progress lines).
        This default hands it over once, at the end: a transport that can read stderr while the command runs
        (local, ssh, the multiplexer, pct over any of them) overrides it."""
        code, out, err = self._run(argv, env=env, stdin=stdin, timeout=timeout)
        if err:
            on_stderr(err)
        return code, out, err

    @abc.abstractmethod
    def stream(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[bytes]:
        """Yield stdout chunks as the command produces them (for `logs -f`). Closing the iterator stops it."""

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        check: bool = True,
        on_stderr: StderrSink | None = None,
    ) -> Result:
        """Run argv; raise `CommandFailed` (carrying the Result) on a non-zero exit when `check`. `on_stderr`
        gets the command's stderr as it arrives (the Result still carries all of it)."""
        merged = {**self.default_env, **(env or {})}
        started = time.monotonic()
        if on_stderr is None:
            code, out, err = self._run(list(argv), env=merged, stdin=stdin, timeout=timeout)
        else:
            code, out, err = self._run_watched(
                list(argv), env=merged, stdin=stdin, timeout=timeout, on_stderr=on_stderr
            )
        result = Result(
            argv=tuple(str(a) for a in argv),
            exit_code=code,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            duration_s=time.monotonic() - started,
            target=self.name,
        )
        if check and not result.ok:
            raise CommandFailed(result)
        return result

    def close(self) -> None:  # noqa: B027 - optional: a transport that holds nothing has nothing to release
        """Release connections. Safe to call twice."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
