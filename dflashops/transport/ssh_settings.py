"""Where and how the ssh transport connects: `SshSettings`, and building them from inventory hosts.

Environment knobs (read here, once per settings object): DFLASHOPS_CONNECT_TIMEOUT (seconds, default 10)
bounds TCP connect, banner, key exchange and authentication each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflashops.core.errors import TransportError


@dataclass(frozen=True)
class SshSettings:
    """Where and how to connect. `host` may be an address or a ~/.ssh/config alias."""

    host: str
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    gateway: SshSettings | None = None
    connect_timeout: float = 10.0
    keepalive_s: int = 15
    trust_name: str | None = None  # the name `dflashops trust NAME` takes (inventory host name)

    def known_hosts_path(self) -> Path:
        return Path(os.path.expanduser(self.known_hosts or "~/.ssh/known_hosts"))


def settings_for_host(
    host: object, hosts: Mapping[str, object] | None = None, *, connect_timeout: float | None = None
) -> SshSettings:
    """SshSettings from an inventory `Host` (duck-typed: this layer does not import the inventory);
    `jump_host` names another inventory host, resolved recursively (a cycle is refused)."""
    seen: set[str] = set()

    def build(entry: object) -> SshSettings:
        name = str(getattr(entry, "name"))
        if name in seen:
            raise TransportError(f"jump_host cycle through host {name!r}", hint="fix jump_host in the inventory")
        seen.add(name)
        # A resolved `gateway` Host object wins; else `jump_host` names another host in `hosts`.
        jump = getattr(entry, "gateway", None)
        jump_name = getattr(entry, "jump_host", None)
        if jump is None and jump_name:
            if hosts is None or jump_name not in hosts:
                raise TransportError(
                    f"host {name!r}: jump_host {jump_name!r} is not an inventory host",
                    hint="add it under hosts: in the inventory",
                )
            jump = hosts[jump_name]
        gateway = build(jump) if jump is not None else None
        port = getattr(entry, "port", None)
        return SshSettings(
            host=str(getattr(entry, "address")),
            user=getattr(entry, "user", None),
            port=int(port) if port else None,
            identity_file=getattr(entry, "identity_file", None),
            known_hosts=getattr(entry, "known_hosts", None),
            gateway=gateway,
            connect_timeout=connect_timeout or float(os.environ.get("DFLASHOPS_CONNECT_TIMEOUT", "10")),
            trust_name=name,
        )

    return build(host)
