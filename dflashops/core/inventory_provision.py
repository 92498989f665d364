"""A pct target's `provision:` block: the container `dflashops provision TARGET` creates and keeps in shape.

    targets:
      ct300:
        kind: pct
        host: pve1                  # the Proxmox host (hosts:)            -> where `pct create` runs
        ctid: 300                   # the vmid                              -> `pct create 300 ...`
        workspace: /workspace
        python: /workspace/venv/bin/python   # the venv provision makes (its `bin/python`)
        provision:
          template: local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst   # or clone: 9000 (a template CT)
          storage: local-lvm        # rootfs storage
          disk_gb: 64
          cores: 16
          memory_mb: 65536
          network: name=eth0,bridge=vmbr0,ip=dhcp     # pct's net0 syntax
          gpus: all                 # or [0, 1]: host GPU indices (/dev/nvidiaK)
          unprivileged: true
          driver_installer: /var/lib/vz/nvidia/NVIDIA-Linux-x86_64-{version}.run   # on the host
          packages: [torch==2.5.1, transformers==4.46.3]                            # pinned, into the venv
          pip_args: [--no-index, --find-links, /workspace/wheels]                   # optional

Everything is checked here (unknown keys rejected, one error naming file, line and key); the host's facts
(driver version, device nodes, free vmids) are checked by ops/provision when it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PROVISION_KEYS = {
    "template", "clone", "storage", "disk_gb", "cores", "memory_mb", "swap_mb", "network", "hostname", "gpus",
    "unprivileged", "driver_installer", "packages", "pip_args",
}  # fmt: skip
# A Proxmox volume id of a template (`pveam list STORAGE` prints them): storage:vztmpl/file
TEMPLATE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*:vztmpl/[A-Za-z0-9][A-Za-z0-9._+-]*$")
STORAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# pct's net0 value: comma-separated key=value pairs, name= and bridge= required (pct(1), "net[n]").
NET_KEYS = {"name", "bridge", "ip", "ip6", "gw", "gw6", "hwaddr", "firewall", "tag", "mtu", "rate", "type", "link_down"}
NET_VALUE_RE = re.compile(r"^[A-Za-z0-9./:_-]+$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
PINNED_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!_-]+$")
PIP_ARG_RE = re.compile(r"^[A-Za-z0-9=/._:+@-]+$")


@dataclass(frozen=True)
class ProvisionSpec:
    """The container as declared; vmid, host and workspace come from the target itself."""

    hostname: str
    storage: str
    disk_gb: int
    cores: int
    memory_mb: int
    network: str
    template: str | None = None
    clone: int | None = None  # the vmid of a container (usually a Proxmox template) on the same host
    swap_mb: int = 0
    gpus: tuple[int, ...] | None = None  # None: every GPU of the host ("all"); () no GPU
    unprivileged: bool = True
    driver_installer: str | None = None  # host path, `{version}` replaced by the host driver's version
    packages: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()
    venv: str | None = None  # from the target's python (`<venv>/bin/python`); None without packages


def parse_provision(reader: Any, node: Any, key: str, target_name: str, python: str) -> ProvisionSpec:
    fields = reader.mapping(node, key, PROVISION_KEYS)

    def scalar(name: str, kind: type, default: Any = None) -> Any:
        return reader.scalar(fields[name], f"{key}.{name}", kind) if name in fields else default

    def positive(name: str, default: int | None = None, minimum: int = 1) -> int:
        value = scalar(name, int, default)
        if value is None:
            raise reader.fail(node, key, f"missing required key {name!r}")
        if value < minimum:
            raise reader.fail(fields.get(name, node), f"{key}.{name}", f"must be at least {minimum}")
        return int(value)

    if ("template" in fields) == ("clone" in fields):
        raise reader.fail(node, key, "name exactly one of 'template' (a pveam volume) or 'clone' (a vmid)")
    template = scalar("template", str)
    if template is not None and not TEMPLATE_RE.match(template):
        raise reader.fail(
            fields["template"], f"{key}.template", "expected a template volume like local:vztmpl/debian-12-...tar.zst"
        )
    clone = scalar("clone", int)
    if clone is not None and clone < 100:
        raise reader.fail(fields["clone"], f"{key}.clone", "Proxmox vmids start at 100")
    for required in ("storage", "network"):
        if required not in fields:
            raise reader.fail(node, key, f"missing required key {required!r}")
    storage = scalar("storage", str)
    if not STORAGE_RE.match(storage):
        raise reader.fail(fields["storage"], f"{key}.storage", "expected a Proxmox storage name (e.g. local-lvm)")
    network = scalar("network", str)
    _check_network(reader, fields["network"], f"{key}.network", network)
    hostname = scalar("hostname", str, target_name)
    if not HOSTNAME_RE.match(hostname):
        raise reader.fail(
            fields.get("hostname", node), f"{key}.hostname", f"{hostname!r} is not a host name (letters, digits, -)"
        )
    installer = scalar("driver_installer", str)
    if installer is not None and not (
        installer.startswith("/") and NET_VALUE_RE.match(installer.replace("{version}", ""))
    ):
        raise reader.fail(
            fields["driver_installer"], f"{key}.driver_installer", "expected an absolute path on the host"
        )
    packages = reader.str_list(fields["packages"], f"{key}.packages") if "packages" in fields else ()
    for package in packages:
        if not PINNED_RE.match(package):
            raise reader.fail(fields["packages"], f"{key}.packages", f"{package!r} is not pinned: write NAME==VERSION")
    pip_args = reader.str_list(fields["pip_args"], f"{key}.pip_args") if "pip_args" in fields else ()
    for arg in pip_args:
        if not PIP_ARG_RE.match(arg):
            raise reader.fail(fields["pip_args"], f"{key}.pip_args", f"{arg!r}: use plain words and paths")
    venv = None
    if packages:
        if not (python.startswith("/") and re.search(r"/bin/python3?$", python)):
            raise reader.fail(
                fields["packages"],
                f"{key}.packages",
                f"packages go into a venv: the target's python ({python!r}) must be a venv's bin/python",
            )
        venv = python.rsplit("/bin/", 1)[0]
    return ProvisionSpec(
        hostname=hostname,
        storage=storage,
        disk_gb=positive("disk_gb"),
        cores=positive("cores"),
        memory_mb=positive("memory_mb", minimum=16),
        swap_mb=positive("swap_mb", 0, minimum=0),
        network=network,
        template=template,
        clone=clone,
        gpus=_gpus(reader, fields, key),
        unprivileged=bool(scalar("unprivileged", bool, True)),
        driver_installer=installer,
        packages=packages,
        pip_args=pip_args,
        venv=venv,
    )


def _gpus(reader: Any, fields: dict[str, Any], key: str) -> tuple[int, ...] | None:
    if "gpus" not in fields:
        return ()
    node = fields["gpus"]
    if getattr(node, "value", None) == "all":
        return None
    gpus = reader.int_list(node, f"{key}.gpus") if not isinstance(getattr(node, "value", None), str) else None
    if gpus is None:
        raise reader.fail(node, f"{key}.gpus", "expected `all` or a list of GPU indices like [0, 1]")
    if len(set(gpus)) != len(gpus) or any(gpu < 0 for gpu in gpus):
        raise reader.fail(node, f"{key}.gpus", "GPU indices are distinct numbers from 0")
    return tuple(sorted(gpus))


def _check_network(reader: Any, node: Any, key: str, value: str) -> None:
    pairs = [part.partition("=") for part in value.split(",")]
    names = [name for name, _, _ in pairs]
    for name, sep, item in pairs:
        if not sep or name not in NET_KEYS or not NET_VALUE_RE.match(item):
            raise reader.fail(node, key, f"{name}{sep}{item!r}: expected key=value pairs like name=eth0,bridge=vmbr0")
    if "name" not in names or "bridge" not in names or len(set(names)) != len(names):
        raise reader.fail(node, key, "needs name= and bridge= once each (pct's net0 syntax)")
