#!/usr/bin/python3
"""PID 1 of a stand-in container (see pct_standin.py): private /tmp and /workspace, then reap orphans.

It must reap: processes entered with nsenter are re-parented to it when their parent exits, and an
unreaped zombie still answers `kill(pid, 0)`, which would make "wait until the run's group is gone" hang.
SIGCHLD stays blocked and is collected with sigtimedwait, so a child dying between the reap loop and the
wait is never missed.
"""

import os
import signal
import subprocess
import sys

container_dir = sys.argv[1]
# Bind the workspace before /tmp: the state directory itself may live under the host's /tmp.
os.makedirs("/workspace", exist_ok=True)
subprocess.run(["mount", "--bind", f"{container_dir}/workspace", "/workspace"], check=True)
subprocess.run(["mount", "--bind", f"{container_dir}/tmp", "/tmp"], check=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
sys.stdout.write("ready\n")
sys.stdout.flush()
os.close(1)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    signal.sigtimedwait({signal.SIGCHLD}, 1.0)
