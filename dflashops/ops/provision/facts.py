"""Read what the planner needs: the host (driver, device nodes, /proc/devices, pct's options, every container's
config, templates, free storage) and the running container (its NVIDIA userspace, python, packages).

Reading only: nothing here changes the host or the container. Host commands go to the Proxmox host's transport
(ssh); `pct`/`pveam`/`pvesm` run through the same `sudo -n` prefix as the pct transport's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from dflashops.core.errors import TransportError
from dflashops.core.inventory import Target
from dflashops.core.inventory_provision import ProvisionSpec
from dflashops.ops.provision import config as cfg
from dflashops.ops.provision.plan import ContainerFacts, DeviceNode, HostFacts
from dflashops.transport.base import Result, Transport

MISMATCH_RE = re.compile(r"NVML library version: (\d+\.\d+(?:\.\d+)?)")
DRIVER_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
# Each node as `path major minor` (stat prints the numbers in hex); a host without the driver has none.
NODES_SCRIPT = 'for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -c "$f" ] && stat -c "%n %t %T" "$f"; done; true'


def parse_driver_version(text: str) -> str | None:
    found = DRIVER_RE.search(text)
    return found.group(1) if found else None


def parse_char_majors(text: str) -> dict[str, int]:
    """/proc/devices' `Character devices:` section: name -> major (`195 nvidia-frontend`, `508 nvidia-uvm`)."""
    majors: dict[str, int] = {}
    section = ""
    for line in text.splitlines():
        if line.endswith(":"):
            section = line
            continue
        parts = line.split()
        if section.startswith("Character") and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def parse_nodes(text: str) -> tuple[DeviceNode, ...]:
    nodes = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].startswith("/dev/nvidia"):
            nodes.append(DeviceNode(parts[0], int(parts[1], 16), int(parts[2], 16)))
    return tuple(nodes)


def read_host(
    host: Transport, pct: Callable[..., list[str]], target: Target, spec: ProvisionSpec, sudo: Sequence[str]
) -> HostFacts:
    """`pct(*args)` is the pct argv (sudo included); `sudo` the prefix for pveam/pvesm."""

    def run(argv: Sequence[str]) -> Result:
        return host.run(argv, check=False, timeout=120)

    listing = run(pct("list"))
    if not listing.ok:
        last = (listing.stderr.strip().splitlines() or [f"exit code {listing.exit_code}"])[-1]
        raise TransportError(f"`pct list` failed on {host.name}: {last}", hint="is this a Proxmox host? (sudo: true?)")
    containers, running = {}, set()
    for line in listing.stdout.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0].isdigit():
            vmid = int(parts[0])
            shown = run(pct("config", str(vmid)))
            containers[vmid] = cfg.parse_config(shown.stdout) if shown.ok else ()
            if len(parts) > 1 and parts[1] == "running":
                running.add(vmid)
    templates: frozenset[str] = frozenset()
    if spec.template is not None:
        listed = run([*sudo, "pveam", "list", spec.template.split(":", 1)[0]])
        if not listed.ok:  # not "the template is missing": the listing itself failed, and says why
            last = (listed.stderr.strip().splitlines() or [f"exit code {listed.exit_code}"])[-1]
            raise TransportError(f"`pveam list` failed on {host.name}: {last}", hint="pveam needs root (sudo: true?)")
        templates = frozenset(line.split()[0] for line in listed.stdout.splitlines()[1:] if line.strip())
    free_gb = None
    status = run([*sudo, "pvesm", "status", "--storage", spec.storage])
    rows = status.stdout.strip().splitlines()
    if status.ok and len(rows) >= 2 and len(rows[1].split()) >= 6 and rows[1].split()[5].isdigit():
        free_gb = int(rows[1].split()[5]) / 2**20  # pvesm prints KiB
    version_text = run(["cat", "/proc/driver/nvidia/version"]).stdout
    driver = parse_driver_version(version_text)
    installer = False
    if spec.driver_installer is not None and driver is not None:
        installer = run(["test", "-f", spec.driver_installer.replace("{version}", driver)]).ok
    return HostFacts(
        host=host.name,
        driver_version=driver,
        device_nodes=parse_nodes(run(["sh", "-c", NODES_SCRIPT]).stdout),
        char_majors=parse_char_majors(run(["cat", "/proc/devices"]).stdout),
        pct_has_dev="dev[n]" in run(pct("help", "set")).stdout,
        containers=containers,
        running=frozenset(running),
        templates=templates,
        storage_free_gb=free_gb,
        installer_present=installer,
    )


def read_container(ct: Transport, spec: ProvisionSpec) -> ContainerFacts:
    def run(argv: Sequence[str]) -> Result:
        return ct.run(argv, check=False, timeout=120)

    query = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    version = query.stdout.strip().splitlines()[0].strip() if query.ok and query.stdout.strip() else None
    if version is None:  # NVML refuses a userspace of another version than the kernel module, and names it
        found = MISMATCH_RE.search(query.stdout + query.stderr)
        version = found.group(1) if found else None
    listed = run(["nvidia-smi", "-L"])
    gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.ok else None
    python3 = run(["sh", "-c", "command -v python3"]).ok
    venv_python = spec.venv is not None and run(["test", "-x", f"{spec.venv}/bin/python"]).ok
    installed: frozenset[str] = frozenset()
    if venv_python:
        frozen = run([f"{spec.venv}/bin/python", "-m", "pip", "freeze", "--disable-pip-version-check"])
        installed = frozenset(
            line.split("==")[0].lower().replace("_", "-") + "==" + line.split("==")[1]
            for line in frozen.stdout.splitlines()
            if "==" in line
        )
    return ContainerFacts(
        nvidia_version=version, gpu_count=gpus, python3=python3, venv_python=venv_python, installed=installed
    )
