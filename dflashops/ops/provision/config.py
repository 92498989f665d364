"""A container's Proxmox config (`pct config VMID`, /etc/pve/lxc/VMID.conf's main section) as ordered lines.

Keys are `key: value` lines; `lxc.*` keys may repeat (one `lxc.cgroup2.devices.allow` per rule), every other key
is unique. Snapshot sections (`[name]`) follow the main section in the file; `pct config` prints the main
section only, which is all that is read here.
"""

from __future__ import annotations

import re

Lines = tuple[tuple[str, str], ...]
OWNER_TAG = "dflashops"
UNFINISHED_TAG = "dflashops-unfinished"  # set at creation, replaced by OWNER_TAG once every step succeeded
DEV_KEY = re.compile(r"^dev(\d+)$")
SIZE_RE = re.compile(r"(?:^|,)size=(\d+(?:\.\d+)?)([KMGT]?)(?:,|$)")


def parse_config(text: str) -> Lines:
    lines: list[tuple[str, str]] = []
    for raw in text.splitlines():
        if raw.startswith("["):
            break  # a snapshot section: not the current config
        if not raw.strip() or raw.startswith("#"):
            continue
        key, sep, value = raw.partition(":")
        if sep:
            lines.append((key.strip(), value.strip()))
    return tuple(lines)


def value(config: Lines, key: str) -> str | None:
    return next((v for k, v in config if k == key), None)


def values(config: Lines, key: str) -> list[str]:
    return [v for k, v in config if k == key]


def render(config: Lines) -> list[str]:
    return [f"{key}: {val}" for key, val in config]


def tags(config: Lines) -> list[str]:
    return [tag for tag in re.split(r"[;, ]+", value(config, "tags") or "") if tag]


def disk_gb(config: Lines) -> float | None:
    """The rootfs size in GiB (`rootfs: local-lvm:vm-300-disk-0,size=64G`), None when not stated."""
    found = SIZE_RE.search(value(config, "rootfs") or "")
    if not found:
        return None
    scale = {"": 1 / 2**30, "K": 1 / 2**20, "M": 1 / 1024, "G": 1, "T": 1024}[found.group(2)]
    return float(found.group(1)) * scale


def dev_entries(config: Lines) -> dict[int, str]:
    """devN index -> the device path of that entry (`dev0: /dev/nvidia0,mode=0666` -> {0: '/dev/nvidia0'})."""
    out = {}
    for key, val in config:
        found = DEV_KEY.match(key)
        if found:
            first = val.split(",")[0]
            out[int(found.group(1))] = first.removeprefix("path=")
    return out


def with_changes(config: Lines, set_values: dict[str, str], delete: set[str]) -> Lines:
    """`config` after `pct set --KEY VALUE ... --delete KEYS`: changed keys keep their place, new ones go last."""
    out = [(k, set_values.get(k, v)) for k, v in config if k not in delete]
    present = {k for k, _ in out}
    out += [(k, v) for k, v in set_values.items() if k not in present]
    return tuple(out)
