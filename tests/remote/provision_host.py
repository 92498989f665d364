"""A fake GPU host for `dflashops provision` tests: a second sshd of the harness inside its own mount namespace,
where /proc/driver/nvidia/version, /proc/devices and /dev/nvidia* say what a Proxmox host with NVIDIA GPUs says.

The device nodes are real character devices (mknod, with the majors the fake /proc/devices lists) on a tmpfs
/dev of that namespace only; nothing on this machine outside it changes. Everything the sshd starts (sudo, the
pct stand-in, the containers it starts) inherits the namespace, so the containers' own /dev (ct_init.py) is made
from these nodes. The NVIDIA installer is a stand-in script: it records its version and flags in the container and
writes an `nvidia-smi` that answers like NVML (a version mismatch, no driver, or the GPUs of the container's /dev).
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import remote_harness
from remote_harness import PROVISION_USER

DRIVER = "550.54.14"
UVM_MAJOR, CAPS_MAJOR = 508, 237
TEMPLATE_FILE = "debian-12-standard_12.7-1_amd64.tar.zst"
TEMPLATE = f"local:vztmpl/{TEMPLATE_FILE}"
NODES = [
    ("nvidia0", 195, 0),
    ("nvidia1", 195, 1),
    ("nvidiactl", 195, 255),
    ("nvidia-uvm", UVM_MAJOR, 0),
    ("nvidia-uvm-tools", UVM_MAJOR, 1),
    ("nvidia-caps/nvidia-cap1", CAPS_MAJOR, 1),
    ("nvidia-caps/nvidia-cap2", CAPS_MAJOR, 2),
]
PROC_DEVICES = f"""Character devices:
  1 mem
  4 /dev/vc/0
  5 /dev/tty
195 nvidia-frontend
{CAPS_MAJOR} nvidia-caps
{UVM_MAJOR} nvidia-uvm

Block devices:
  7 loop
  8 sd
"""
NVIDIA_SMI = r"""#!/bin/sh
# nvidia-smi of the installer stand-in (userspace VERSION)
V=VERSION
K=$(sed -n 's/.*Kernel Module *\([0-9][0-9.]*\).*/\1/p' /proc/driver/nvidia/version 2>/dev/null)
if [ ! -c /dev/nvidiactl ] || [ -z "$K" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9
fi
if [ "$K" != "$V" ]; then
  echo "Failed to initialize NVML: Driver/library version mismatch"; echo "NVML library version: $V"; exit 18
fi
i=0
for d in /dev/nvidia[0-9]*; do
  [ -c "$d" ] || continue
  case "$1" in -L) echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000-${d#/dev/nvidia})";; *) echo "$V";; esac
  i=$((i+1))
done
"""
INSTALLER = """#!/bin/sh
# Stand-in for NVIDIA-Linux-x86_64-VERSION.run: records version and flags, installs the userspace (nvidia-smi).
echo "VERSION $*" >> /usr/local/bin/.nvidia-installer.log
if [ -e /workspace/.slow-installer ]; then sleep 20; fi   # a test kills the provision run meanwhile
case " $* " in *" --no-kernel-module "*) ;; *) echo "ERROR: Unable to load the kernel module 'nvidia.ko'." >&2; exit 1;; esac
cat > /usr/local/bin/nvidia-smi <<'SMI'
NVIDIA_SMI
SMI
chmod 755 /usr/local/bin/nvidia-smi
"""


def installer_text(version: str) -> str:
    return INSTALLER.replace("NVIDIA_SMI", NVIDIA_SMI.rstrip("\n")).replace("VERSION", version)


def version_line(version: str) -> str:
    return (
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Thu Feb 22 01:44:30 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )


@dataclass
class GpuHost:
    harness: remote_harness.Harness
    folder: Path
    port: int
    sshd: subprocess.Popen

    @property
    def knobs(self) -> Path:
        return self.harness.pct_state / ".host"

    def installer_path(self, version: str = DRIVER) -> Path:
        return self.folder / "installers" / f"NVIDIA-Linux-x86_64-{version}.run"

    @property
    def sudoers_file(self) -> Path:
        return self.harness.sudoers_file.with_name(self.harness.sudoers_file.name + "-provision")

    def stop(self) -> None:
        if self.sshd.poll() is None:
            self.sshd.terminate()
            self.sshd.wait(10)
        self.sudoers_file.unlink(missing_ok=True)


def start_gpu_host(harness: remote_harness.Harness) -> GpuHost:
    port = remote_harness.free_port()
    folder = harness.root / f"gpuhost-{port}"
    (folder / "installers").mkdir(parents=True)
    (folder / "version").write_text(version_line(DRIVER))
    (folder / "devices").write_text(PROC_DEVICES)
    installer = folder / "installers" / f"NVIDIA-Linux-x86_64-{DRIVER}.run"
    installer.write_text(installer_text(DRIVER))
    knobs = harness.pct_state / ".host"
    (knobs / "templates" / "local").mkdir(parents=True, exist_ok=True)
    (knobs / "templates" / "local" / TEMPLATE_FILE).write_bytes(b"template stand-in")
    (knobs / "storage").mkdir(exist_ok=True)
    nodes = " && ".join(f"mknod -m 666 /dev/{name} c {major} {minor}" for name, major, minor in NODES)
    stage = (
        "set -e; mount -t tmpfs tmpfs /proc/driver; mkdir /proc/driver/nvidia; "
        f"cp {folder}/version /proc/driver/nvidia/version; "
        f"mount --bind {folder}/devices /proc/devices; "
        "mount -t tmpfs -o mode=1777 tmpfs /run/lock; "  # the host's own /run/lock (provision's lock folders)
        "mount -t tmpfs -o mode=755 tmpfs /dev; mkdir /dev/nvidia-caps /dev/pts /dev/shm; "
        "mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/random c 1 8; "
        f"mknod -m 666 /dev/urandom c 1 9; mknod -m 666 /dev/tty c 5 0; {nodes}; "
        'exec "$@"'
    )
    wrapper = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", stage, "gpuhost")
    remote_harness.ensure_test_user(PROVISION_USER)
    tools = remote_harness.PROVISION_STANDIN_DIR
    sudoers = harness.sudoers_file.with_name(harness.sudoers_file.name + "-provision")
    sudoers.write_text(
        f'Defaults:{PROVISION_USER} secure_path="{tools}:/usr/sbin:/usr/bin:/sbin:/bin"\n'
        f'Defaults:{PROVISION_USER} env_keep += "DFO_PCT_STATE"\n'
        f"{PROVISION_USER} ALL=(root) NOPASSWD: {', '.join(f'{tools}/{tool}' for tool in remote_harness.STANDIN_TOOLS)}\n"
    )
    sudoers.chmod(0o440)
    sshd = remote_harness.start_sshd(harness.root, port, folder, wrapper=wrapper, user=PROVISION_USER, tools=tools)
    return GpuHost(harness=harness, folder=folder, port=port, sshd=sshd)


def set_host_driver(host: GpuHost, version: str) -> None:
    """A host driver upgrade, as the host's /proc shows it (the namespace's copy; containers see it at start)."""
    command = f"printf %s {shlex.quote(version_line(version))} > /proc/driver/nvidia/version"
    subprocess.run(["nsenter", f"--target={host.sshd.pid}", "--mount", "--", "sh", "-c", command], check=True)


def host_pct(host: GpuHost, *args: str) -> subprocess.CompletedProcess:
    """The stand-in pct as the fake GPU host runs it (inside its namespace: `pct start` copies the driver version
    the container will see from there)."""
    pct = str(remote_harness.PROVISION_STANDIN_DIR / "pct")
    return subprocess.run(
        ["nsenter", f"--target={host.sshd.pid}", "--mount", "--", pct, *args],
        capture_output=True,
        text=True,
        check=True,
        env=host.harness.standin_env,
    )


def add_installer(host: GpuHost, version: str) -> None:
    host.installer_path(version).write_text(installer_text(version))


def in_host(host: GpuHost, script: str) -> subprocess.CompletedProcess:
    """A shell command in the fake GPU host's mount namespace (its /run/lock, /dev and /proc files)."""
    return subprocess.run(
        ["nsenter", f"--target={host.sshd.pid}", "--mount", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        check=True,
    )
