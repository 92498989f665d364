#!/usr/bin/python3
"""A stand-in for Proxmox's `pct`, for tests: containers are long-lived PID + mount namespaces.

Installed by the harness as `/usr/local/lib/dflashops-test/pct` (one copy shared by concurrent test
sessions). Each session's sshd sets DFO_PCT_STATE (its own state root, kept through sudo by an env_keep
rule), so two sessions never see each other's containers. Each container CTID has `STATE_ROOT/<ctid>/`:

    <ctid>.conf     exists  <=> the container exists ("Configuration file ... does not exist" otherwise)
    init.pid        host PID of the namespace's PID 1 while it runs
    workspace/      bind-mounted on /workspace inside the container
    tmp/            bind-mounted on /tmp inside the container (private /tmp: own tmux sockets)

`pct start` runs `unshare --pid --fork --mount-proc python3 ct_init.py` detached; `pct exec` is
`nsenter --target <init> --pid --mount -- argv`, exec'd so stdin/stdout/exit code pass straight through.
A kill inside a container can only reach that container's PID namespace, as with real LXC.
Words and exit codes follow Proxmox's (`pct` dies with exit 255 and a one-line message).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

STATE_ROOT = Path(os.environ.get("DFO_PCT_STATE", "/nonexistent"))
INIT_SCRIPT = Path(__file__).resolve().with_name("ct_init.py")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def die(message: str, code: int = 255) -> NoReturn:
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.exit(code)


def ct_dir(ctid: str) -> Path:
    if not ctid.isdigit():
        die("400 Parameter verification failed.\nvmid: invalid format - value does not look like a valid VM ID")
    directory = STATE_ROOT / ctid
    if not (directory / f"{ctid}.conf").exists():
        die(f"Configuration file 'nodes/{socket.gethostname()}/lxc/{ctid}.conf' does not exist")
    return directory


def init_pid(directory: Path) -> int | None:
    """The namespace init's host PID, or None when stopped (a stale pid file is checked against /proc)."""
    try:
        pid = int((directory / "init.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"ct_init.py" in cmdline else None


def cmd_status(ctid: str) -> None:
    print("status: running" if init_pid(ct_dir(ctid)) else "status: stopped")


def cmd_list() -> None:
    print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} Name")
    for conf in sorted(STATE_ROOT.glob("*/*.conf"), key=lambda p: int(p.stem)):
        state = "running" if init_pid(conf.parent) else "stopped"
        name = conf.read_text().strip().partition("hostname:")[2].strip() or f"ct{conf.stem}"
        print(f"{conf.stem:<10} {state:<10} {'':<12} {name}")


def cmd_start(ctid: str) -> None:
    directory = ct_dir(ctid)
    if init_pid(directory):
        die(f"CT {ctid} already running")
    for sub in ("workspace", "tmp"):
        (directory / sub).mkdir(exist_ok=True)
    (directory / "tmp").chmod(0o1777)
    launcher = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--", sys.executable, str(INIT_SCRIPT), str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ready = launcher.stdout.readline().decode().strip() if launcher.stdout else ""
    if ready != "ready":
        die(f"startup for container '{ctid}' failed")
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    (directory / "init.pid").write_text(children[0])


def cmd_stop(ctid: str) -> None:
    directory = ct_dir(ctid)
    pid = init_pid(directory)
    if pid is None:
        die(f"CT {ctid} not running")
    os.kill(pid, 9)  # PID 1 of the namespace: the kernel kills everything inside with it
    for _ in range(200):
        if init_pid(directory) is None:
            break
        time.sleep(0.01)
    (directory / "init.pid").unlink(missing_ok=True)


def enter_argv(pid: int, argv: list[str]) -> list[str]:
    return ["nsenter", f"--target={pid}", "--pid", "--mount", "--wd=/", "--", *argv]


def running_pid(ctid: str) -> int:
    pid = init_pid(ct_dir(ctid))
    if pid is None:
        die(f"CT {ctid} not running")
    return pid


def cmd_exec(args: list[str]) -> None:
    if not args:
        die("400 not enough arguments\npct exec <vmid> [<extra-args>] [OPTIONS]")
    ctid, rest = args[0], args[1:]
    keep_env = True  # Proxmox's current default, with a deprecation notice
    while rest and rest[0] != "--":
        if rest[0] == "--keep-env" and len(rest) > 1 and rest[1] in ("0", "1"):
            keep_env, rest = rest[1] == "1", rest[2:]
        else:
            die(f"Unknown option: {rest[0]}")
    command = rest[1:]
    if not command:
        die("missing command")
    pid = running_pid(ctid)
    env = dict(os.environ) if keep_env else {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    os.execvpe("nsenter", enter_argv(pid, command), env)


def cmd_push(ctid: str, source: str, dest: str) -> None:
    pid = running_pid(ctid)
    with open(source, "rb") as data:
        code = subprocess.call(enter_argv(pid, ["sh", "-c", 'cat > "$1"', "sh", dest]), stdin=data)
    if code:
        die(f"failed to create file: {dest}")


def cmd_pull(ctid: str, source: str, dest: str) -> None:
    pid = running_pid(ctid)
    with open(dest, "wb") as out:
        code = subprocess.call(enter_argv(pid, ["cat", "--", source]), stdout=out)
    if code:
        die(f"failed to open {source} for reading")


def main(argv: list[str]) -> None:
    if os.geteuid() != 0:
        die("only root can use this command.")
    # Only a harness state root (a temp dir of our own) is accepted: this runs as root via sudo.
    if not (
        STATE_ROOT.is_absolute()
        and STATE_ROOT.name == "pct"
        and STATE_ROOT.parent.name.startswith("dfo-remote-")
        and STATE_ROOT.is_dir()
    ):
        die("pct stand-in: DFO_PCT_STATE does not name a harness state directory")
    if not argv:
        die("ERROR: no command specified")
    verb, args = argv[0], argv[1:]
    if verb == "list":
        cmd_list()
    elif verb == "status" and args:
        cmd_status(args[0])
    elif verb == "start" and args:
        cmd_start(args[0])
    elif verb == "stop" and args:
        cmd_stop(args[0])
    elif verb == "exec":
        cmd_exec(args)
    elif verb == "push" and len(args) == 3:
        cmd_push(*args)
    elif verb == "pull" and len(args) == 3:
        cmd_pull(*args)
    else:
        die(f"ERROR: unknown command 'pct {' '.join(argv)}'")


if __name__ == "__main__":
    main(sys.argv[1:])
