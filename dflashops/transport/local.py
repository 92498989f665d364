"""The local transport: argv lists run with subprocess on this machine (the demo target, the fast test tier).

No shell is involved: argv goes straight to execve. The environment of a command is this process's
environment plus the target's default env plus the call's env.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from dflashops.errors import TransportError
from dflashops.transport.base import Stdin, Transport


@dataclass
class LocalTransport(Transport):
    """Runs commands here. Binary stdin (bytes or a file object) is passed through untouched."""

    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        data = stdin if stdin is None or isinstance(stdin, (bytes, bytearray, memoryview)) else stdin.read()
        try:
            proc = subprocess.run(
                list(argv),
                input=data,
                env={**os.environ, **env},
                capture_output=True,
                timeout=timeout,
                stdin=None if data is not None else subprocess.DEVNULL,
            )
        except FileNotFoundError:
            return 127, b"", f"{argv[0]}: command not found\n".encode()
        except OSError as exc:  # not executable, a directory, not a program: what a shell reports as 126
            return 126, b"", f"{argv[0]}: cannot execute: {exc.strerror}\n".encode()
        except subprocess.TimeoutExpired:
            raise TransportError(
                f"command timed out after {timeout:g}s on {self.name}: {argv[0]}",
                hint="raise --timeout or check the target",
            ) from None
        return proc.returncode, proc.stdout, proc.stderr

    def stream(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> Iterator[bytes]:
        """Yield stdout chunks as they arrive; closing the generator terminates the child."""
        try:
            proc = subprocess.Popen(
                list(argv),
                env={**os.environ, **self.default_env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
            )
        except FileNotFoundError:
            raise TransportError(f"{argv[0]}: command not found on {self.name}") from None
        except OSError as exc:
            raise TransportError(f"{argv[0]}: cannot execute on {self.name}: {exc.strerror}") from None
        assert proc.stdout is not None
        try:
            while chunk := proc.stdout.read1(65536):  # type: ignore[attr-defined]  # a PIPE is a BufferedReader
                yield chunk
        finally:
            if proc.poll() is None:
                proc.terminate()  # our own child, by pid
            proc.wait()
