"""Starting a helper process that outlives this one (the notification courier): the only other place, beside the
transports, that starts a process on this machine.

The helper is double-forked away from the CLI: an intermediate interpreter (isolated, no site: ~15 ms) calls
setsid, forks the helper and exits at once, so the CLI waits only for that, the helper is no child of the CLI
(no zombie, no "still running" warning in a long-lived caller), and a Ctrl-C in the CLI's terminal does not
reach it. Its request travels on stdin (it may carry a secret such as a webhook URL: never on a command line).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_DOUBLE_FORK = "import os,sys\nos.setsid()\nif os.fork(): os._exit(0)\nos.execv(sys.argv[1], sys.argv[1:])"


def start_detached(argv: Sequence[str], *, stdin: bytes, log: Path, env: Mapping[str, str]) -> None:
    """Start `argv` (argv[0] an absolute path) detached, reading `stdin`, its output appended to `log`."""
    with open(log, "ab") as out:
        intermediate = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _DOUBLE_FORK, *argv],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=dict(env),
            close_fds=True,
        )
    assert intermediate.stdin is not None
    try:
        intermediate.stdin.write(stdin)  # a few hundred bytes: the pipe holds them for the helper to read
        intermediate.stdin.close()
    except BrokenPipeError:  # the helper could not start; its log says why
        pass
    intermediate.wait()
