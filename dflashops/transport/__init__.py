"""Transports: the only place that touches subprocess, fabric or paramiko. `open_transport` picks one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflashops.errors import TransportError
from dflashops.transport.base import Result, Transport

if TYPE_CHECKING:
    from dflashops.inventory import Target

__all__ = ["Result", "Transport", "open_transport"]


def open_transport(target: "Target") -> Transport:
    """A Transport for the target's kind. One per CLI invocation; close it (or use `with`) when done."""
    if target.kind == "local":
        from dflashops.transport.local import LocalTransport

        return LocalTransport(name=target.name, default_env={})
    raise TransportError(
        f"target {target.name!r} is of kind {target.kind!r}, which this build cannot reach yet",
        hint="only 'local' targets work until the ssh/pct transports land",
    )
