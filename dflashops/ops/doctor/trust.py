"""`trust`: fetch a host's SSH key and record it in known_hosts once the user has compared its fingerprint.

The prompt is the CLI's; here are the two steps around it. Imports of fabric/paramiko happen inside, so only
this verb pays them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashops.core.errors import UsageError
from dflashops.core.inventory import Inventory


@dataclass
class HostKeyOffer:
    """What the host presented: the name it is known under, its key type and SHA256 fingerprint."""

    known_name: str
    key_type: str
    fingerprint: str
    known_hosts: Path
    key: Any  # the paramiko key, for record()


def settings_for(inventory: Inventory, name: str) -> Any:
    """SshSettings of an inventory host, a remote target's host, or an ssh_config alias / bare address."""
    from dflashops.transport.ssh_settings import SshSettings, settings_for_host

    if name in inventory.hosts:
        return settings_for_host(inventory.hosts[name], inventory.hosts)
    if name in inventory.targets and inventory.targets[name].host is not None:
        return settings_for_host(inventory.targets[name].host, inventory.hosts)
    if name in inventory.targets:
        raise UsageError(f"target {name!r} is local: there is no host key to trust")
    return SshSettings(host=name, trust_name=name)


def fetch_offer(inventory: Inventory, name: str) -> HostKeyOffer:
    from dflashops.transport.ssh_connect import fetch_host_key
    from dflashops.transport.ssh_keys import fingerprint

    settings = settings_for(inventory, name)
    known_name, key = fetch_host_key(settings)
    return HostKeyOffer(
        known_name=known_name,
        key_type=key.get_name(),
        fingerprint=fingerprint(key),
        known_hosts=settings.known_hosts_path(),
        key=key,
    )


def record(offer: HostKeyOffer) -> bool:
    """Append the key to known_hosts; False when it was there already."""
    from dflashops.transport.ssh_keys import record_host_key

    return record_host_key(offer.known_hosts, offer.known_name, offer.key)
