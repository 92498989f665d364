"""The local transport: argv lists run with subprocess on this machine (the demo target, the fast test tier).

No shell is involved: argv goes straight to execve. The environment of a command is this process's
environment plus the target's default env plus the call's env.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from dflashops.core.errors import TransportError
from dflashops.transport.base import StderrSink, Stdin, Transport

CHUNK = 1 << 20  # what a streamed stdin is copied in


@dataclass
class LocalTransport(Transport):
    """Runs commands here. Binary stdin (bytes or a file object) is passed through untouched; a file object is
    copied to the command in chunks as it reads them, never read whole here (a release's tar, upload.py)."""

    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        if stdin is not None and not isinstance(stdin, (bytes, bytearray, memoryview)):
            return self._run_watched(argv, env=env, stdin=stdin, timeout=timeout, on_stderr=lambda _chunk: None)
        data = stdin
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

    def _run_watched(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink,
    ) -> tuple[int, bytes, bytes]:
        """`_run`, with stderr read by a thread and handed to `on_stderr` chunk by chunk as the command writes it."""
        try:
            proc = subprocess.Popen(
                list(argv),
                env={**os.environ, **env},
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except FileNotFoundError:
            return 127, b"", f"{argv[0]}: command not found\n".encode()
        except OSError as exc:
            return 126, b"", f"{argv[0]}: cannot execute: {exc.strerror}\n".encode()
        err = bytearray()

        def read_stderr() -> None:
            assert proc.stderr is not None
            while chunk := proc.stderr.read1(65536):  # type: ignore[attr-defined]  # a PIPE is a BufferedReader
                err.extend(chunk)
                on_stderr(chunk)

        def feed() -> None:
            assert proc.stdin is not None
            try:
                if stdin is None or isinstance(stdin, (bytes, bytearray, memoryview)):
                    proc.stdin.write(bytes(stdin or b""))
                else:
                    while chunk := stdin.read(CHUNK):  # one chunk held at a time
                        proc.stdin.write(chunk)
            except (BrokenPipeError, OSError):  # it exited without reading all of it: its answer says why
                pass
            finally:
                with contextlib.suppress(OSError):  # a broken pipe's buffered rest cannot be flushed: dropped
                    proc.stdin.close()

        # Three readers/writers, each on its own pipe (communicate() would read stderr too, racing the reader).
        helpers = [threading.Thread(target=read_stderr, name="stderr-reader", daemon=True)]
        if stdin is not None:
            helpers.append(threading.Thread(target=feed, name="stdin-feeder", daemon=True))
        for helper in helpers:
            helper.start()
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            proc.kill()  # our own child, by pid

        timer = threading.Timer(timeout, expire) if timeout is not None else None
        if timer is not None:
            timer.start()
        try:
            assert proc.stdout is not None
            out = proc.stdout.read()
            proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
        for helper in helpers:
            helper.join()
        if timed_out.is_set():
            raise TransportError(
                f"command timed out after {timeout:g}s on {self.name}: {argv[0]}",
                hint="raise --timeout or check the target",
            )
        return proc.returncode, out, bytes(err)

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
