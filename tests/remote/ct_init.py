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
# Everything under container_dir is read or bound before /tmp is: the state directory itself may live under the
# host's /tmp, which the container's private /tmp hides.
provisioned = os.path.exists(f"{container_dir}/provisioned")
devices, driver_version = [], None
if provisioned:
    # A container made by `pct create/clone`: its own /usr/local/bin (what is installed in it), a /dev with only
    # the devices its config passes through (as LXC gives it), and the host driver's version where the NVIDIA
    # userspace reads it (the fresh /proc of --mount-proc lacks the fake host's).
    with open(f"{container_dir}/devices") as listing:
        devices = [line.split() for line in listing if line.strip()]
    if os.path.exists(f"{container_dir}/driver_version"):
        with open(f"{container_dir}/driver_version") as source:
            driver_version = source.read()
    subprocess.run(["mount", "--bind", f"{container_dir}/usr-local-bin", "/usr/local/bin"], check=True)
os.makedirs("/workspace", exist_ok=True)
subprocess.run(["mount", "--bind", f"{container_dir}/workspace", "/workspace"], check=True)
subprocess.run(["mount", "--bind", f"{container_dir}/tmp", "/tmp"], check=True)
if provisioned:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/dev"], check=True)
    for name, major, minor in (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9)):
        os.mknod(f"/dev/{name}", 0o20666, os.makedev(major, minor))
    os.mknod("/dev/tty", 0o20666, os.makedev(5, 0))
    os.makedirs("/dev/pts")
    os.makedirs("/dev/shm")
    subprocess.run(["mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666", "devpts", "/dev/pts"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/dev/shm"], check=True)
    os.symlink("pts/ptmx", "/dev/ptmx")  # ptys for tmux, as LXC sets them up
    for path, major, minor in devices:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mknod(path, 0o20666, os.makedev(int(major), int(minor)))
    if driver_version is not None:
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/proc/driver"], check=True)
        os.makedirs("/proc/driver/nvidia")
        with open("/proc/driver/nvidia/version", "w") as out:
            out.write(driver_version)
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
