"""Transports: the only place that touches subprocess, fabric or paramiko. `open_transport` picks one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflashops.core.errors import TransportError
from dflashops.transport.base import Result, Transport

if TYPE_CHECKING:
    from dflashops.core.inventory import Target

__all__ = ["Result", "Transport", "open_transport"]


def open_transport(target: Target) -> Transport:
    """A Transport for the target's kind. One per CLI invocation; close it (or use `with`) when done."""
    if target.kind == "local":
        from dflashops.transport.local import LocalTransport

        return LocalTransport(name=target.name, default_env={})
    if target.kind in ("pct", "direct", "host"):
        from dflashops.transport.pct import open_remote

        return open_remote(target)  # pct: ssh to the Proxmox host + `pct exec`; direct/host: ssh
    raise TransportError(
        f"target {target.name!r} has unknown kind {target.kind!r}", hint="kinds: local, pct, direct, host"
    )
