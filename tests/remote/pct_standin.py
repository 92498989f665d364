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

For `dflashops provision` it also answers `create/set/config/clone/resize/destroy/help set` (the config kept in
`<ctid>.conf` in Proxmox's format: keys sorted, raw `lxc.*` keys last), and, called as `pveam` or `pvesm`,
`pveam list STORAGE` and `pvesm status --storage NAME` (see HOST_DIR below).
"""

from __future__ import annotations

import os
import re
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


# -- provisioning: create/set/config/clone/resize/destroy, pveam, pvesm ----------------------------------
# Host knobs (files under STATE_ROOT/.host/, written by tests): `no-dev` makes this an older pct without devN;
# `templates/<storage>/<file>` are the templates `pveam list` shows; `storage/<name>` holds its free KiB.
# A container made by create/clone has `provisioned` in its folder: it starts with a private /usr/local/bin
# (its own installs) and a /dev holding only the devices its config passes through (ct_init.py).
HOST_DIR = STATE_ROOT / ".host"
SET_KEYS = {"hostname", "cores", "memory", "swap", "net0", "tags", "features", "description", "onboot", "unprivileged"}
DEV_RE = re.compile(r"^dev(\d+)$")


def node() -> str:
    return socket.gethostname()


def read_conf(ctid: str) -> list[tuple[str, str]]:
    lines = []
    for raw in (ct_dir(ctid) / f"{ctid}.conf").read_text().splitlines():
        if raw.startswith("["):
            break
        key, sep, value = raw.partition(":")
        if sep:
            lines.append((key.strip(), value.strip()))
    return lines


def write_conf(ctid: str, lines: list[tuple[str, str]]) -> None:
    """Proxmox writes the keys sorted, the raw lxc.* keys last in their own order."""
    plain = sorted((k, v) for k, v in lines if not k.startswith("lxc."))
    raw = [(k, v) for k, v in lines if k.startswith("lxc.")]
    path = STATE_ROOT / ctid / f"{ctid}.conf"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{k}: {v}\n" for k, v in [*plain, *raw]))
    os.replace(tmp, path)


def options(args: list[str], allowed: set[str], verb: str) -> dict[str, str]:
    out: dict[str, str] = {}
    while args:
        word = args.pop(0)
        key = word[2:] if word.startswith("--") else ""
        if not key or not args:
            die(f"400 not enough arguments\npct {verb} <vmid> [OPTIONS]" if key else f"Unknown option: {word}")
        if key not in allowed and not (DEV_RE.match(key) and not (HOST_DIR / "no-dev").exists()):
            die(f"Unknown option: {key}\n400 unable to parse option\npct {verb} <vmid> [OPTIONS]")
        out[key] = args.pop(0)
    return out


def mac() -> str:
    return "BC:24:11:" + ":".join(f"{b:02X}" for b in os.urandom(3))


def storage_free_kib(storage: str) -> int:
    try:
        return int((HOST_DIR / "storage" / storage).read_text())
    except (OSError, ValueError):
        return 1 << 40


def new_ct(ctid: str, verb: str) -> Path:
    if not ctid.isdigit() or int(ctid) < 100:
        die("400 Parameter verification failed.\nvmid: invalid format - value does not look like a valid VM ID")
    directory = STATE_ROOT / ctid
    if (directory / f"{ctid}.conf").exists():
        die(f"unable to {verb} CT {ctid} - CT {ctid} already exists on node '{node()}'")
    directory.mkdir(exist_ok=True)
    (directory / "provisioned").touch()
    return directory


def cmd_create(args: list[str]) -> None:
    if len(args) < 2:
        die("400 not enough arguments\npct create <vmid> <ostemplate> [OPTIONS]")
    ctid, template, opts = args[0], args[1], options(args[2:], SET_KEYS | {"rootfs", "storage"}, "create")
    storage, _, volume = template.partition(":")
    if not (HOST_DIR / "templates" / storage / volume.removeprefix("vztmpl/")).is_file():
        die(f"unable to create CT {ctid} - volume '{template}' does not exist")
    disk_storage, _, size = opts.pop("rootfs", f"{opts.get('storage', 'local')}:4").partition(":")
    opts.pop("storage", None)
    if int(size) * 1024 * 1024 > storage_free_kib(disk_storage):
        die(
            f"unable to create CT {ctid} - lvcreate 'pve/vm-{ctid}-disk-0' error: Volume group \"pve\" has "
            f"insufficient free space"
        )
    directory = new_ct(ctid, "create")
    net = opts.pop("net0", "")
    lines = [("arch", "amd64"), ("ostype", "debian"), ("rootfs", f"{disk_storage}:vm-{ctid}-disk-0,size={size}G")]
    if net:
        parts = net.split(",")
        lines.append(("net0", ",".join([parts[0], *parts[1:2], f"hwaddr={mac()}", *parts[2:], "type=veth"])))
    lines += list(opts.items())
    (directory / f"{ctid}.conf").write_text("")
    write_conf(ctid, lines)


def cmd_set(args: list[str]) -> None:
    if not args:
        die("400 not enough arguments\npct set <vmid> [OPTIONS]")
    ctid = args[0]
    ct_dir(ctid)
    opts = options(args[1:], SET_KEYS | {"delete"}, "set")
    delete = set(filter(None, opts.pop("delete", "").split(",")))
    for key, value in opts.items():
        path = value.split(",")[0].removeprefix("path=")
        if DEV_RE.match(key) and not os.path.exists(path):
            die(f"400 Parameter verification failed.\n{key}: Device {path} does not exist")
    lines = [(k, opts.pop(k, v)) for k, v in read_conf(ctid) if k not in delete]
    write_conf(ctid, lines + list(opts.items()))


def cmd_config(ctid: str) -> None:
    for key, value in read_conf(ctid):
        print(f"{key}: {value}")


def cmd_clone(args: list[str]) -> None:
    if len(args) < 2:
        die("400 not enough arguments\npct clone <vmid> <newid> [OPTIONS]")
    source, ctid = args[0], args[1]
    lines = read_conf(source)
    opts = options(args[2:], {"hostname", "full", "storage", "description"}, "clone")
    new_ct(ctid, "clone")
    hostname = opts.get("hostname", f"CT{ctid}")
    out = []
    for key, value in lines:
        if key == "net0":
            value = ",".join(p if not p.startswith("hwaddr=") else f"hwaddr={mac()}" for p in value.split(","))
        if key == "rootfs":
            value = re.sub(r"^([^:]+):vm-\d+-", lambda m: f"{opts.get('storage', m.group(1))}:vm-{ctid}-", value)
        if key not in ("hostname", "template"):
            out.append((key, value))
    (STATE_ROOT / ctid / f"{ctid}.conf").write_text("")
    write_conf(ctid, [*out, ("hostname", hostname)])


def cmd_resize(ctid: str, disk: str, size: str) -> None:
    lines = read_conf(ctid)
    if disk != "rootfs" or not re.fullmatch(r"\+?\d+G", size):
        die(f"400 Parameter verification failed.\nsize: unable to parse size '{size}'")
    out = []
    for key, value in lines:
        if key == "rootfs":
            value = re.sub(r"size=\d+G", f"size={size.lstrip('+')}G".replace("GG", "G"), value)
        out.append((key, value))
    write_conf(ctid, out)


def cmd_destroy(args: list[str]) -> None:
    ctid = args[0] if args else ""
    directory = ct_dir(ctid)
    if init_pid(directory):
        die(f"CT {ctid} is running - destroy failed")
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    directory.rmdir()


def cmd_help(args: list[str]) -> None:
    if args != ["set"]:
        die(f"no such command '{' '.join(args)}'")
    print("USAGE: pct set <vmid> [OPTIONS]\n\n  Set container options.\n")
    print("  <vmid>     <integer> (100 - 999999999)\n  -cores     <integer> (1 - 8192)\n  -delete    <string>")
    if not (HOST_DIR / "no-dev").exists():
        print(
            "  -dev[n]    [[path=]<Path>] [,deny-write=<1|0>] [,gid=<integer>] [,mode=<Octal access mode>] [,uid=<integer>]"
        )
    print("  -hostname  <string>\n  -memory    <integer> (16 - N)\n  -net[n]    name=<string> [,bridge=<bridge>] ...")


def pveam(args: list[str]) -> None:
    if args[:1] != ["list"] or len(args) != 2:
        die("ERROR: unknown command 'pveam " + " ".join(args) + "'")
    folder = HOST_DIR / "templates" / args[1]
    print(f"{'NAME':<70} SIZE")
    for file in sorted(folder.glob("*")) if folder.is_dir() else []:
        print(f"{args[1] + ':vztmpl/' + file.name:<70} {file.stat().st_size / 1e6:.2f}MB")


def pvesm(args: list[str]) -> None:
    if args[:2] != ["status", "--storage"] or len(args) != 3:
        die("ERROR: unknown command 'pvesm " + " ".join(args) + "'")
    free = storage_free_kib(args[2])
    print("Name             Type     Status           Total            Used       Available        %")
    print(f"{args[2]:<16} lvmthin  active {free * 2:>15} {free:>15} {free:>15}   50.00%")


def cmd_status(ctid: str) -> None:
    print("status: running" if init_pid(ct_dir(ctid)) else "status: stopped")


def cmd_list() -> None:
    print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} Name")
    for conf in sorted(STATE_ROOT.glob("*/*.conf"), key=lambda p: int(p.stem)):
        state = "running" if init_pid(conf.parent) else "stopped"
        found = re.search(r"^hostname:\s*(\S+)", conf.read_text(), re.M)
        name = found.group(1) if found else f"ct{conf.stem}"
        print(f"{conf.stem:<10} {state:<10} {'':<12} {name}")


def cmd_start(ctid: str) -> None:
    directory = ct_dir(ctid)
    if init_pid(directory):
        die(f"CT {ctid} already running")
    for sub in ("workspace", "tmp"):
        (directory / sub).mkdir(exist_ok=True)
    (directory / "tmp").chmod(0o1777)
    if (directory / "provisioned").exists():
        passed = [value.split(",")[0].removeprefix("path=") for key, value in read_conf(ctid) if DEV_RE.match(key)]
        passed += [value.split()[0] for key, value in read_conf(ctid) if key == "lxc.mount.entry"]
        nodes = []
        for path in passed:
            try:
                info = os.stat(path)
            except OSError:
                continue
            nodes.append(f"{path} {os.major(info.st_rdev)} {os.minor(info.st_rdev)}\n")
        (directory / "devices").write_text("".join(nodes))
        try:
            (directory / "driver_version").write_text(Path("/proc/driver/nvidia/version").read_text())
        except OSError:
            (directory / "driver_version").unlink(missing_ok=True)
        (directory / "usr-local-bin").mkdir(exist_ok=True)
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
    tool = Path(sys.argv[0]).name
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
    if tool in ("pveam", "pvesm"):
        return pveam(argv) if tool == "pveam" else pvesm(argv)
    verb, args = argv[0], argv[1:]
    if verb == "create":
        cmd_create(args)
    elif verb == "set":
        cmd_set(args)
    elif verb == "config" and len(args) == 1:
        cmd_config(args[0])
    elif verb == "clone":
        cmd_clone(args)
    elif verb == "resize" and len(args) == 3:
        cmd_resize(*args)
    elif verb == "destroy":
        cmd_destroy(args)
    elif verb == "help":
        cmd_help(args)
    elif verb == "list":
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
