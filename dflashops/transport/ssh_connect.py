"""Opening an ssh connection: a Fabric Connection whose host-key policy refuses unknown keys (gateways
included), and `fetch_host_key` for `dflashops trust` (a bare key exchange, no login). Beside ssh.py (which
runs commands) and ssh_keys.py (keys, fingerprints, error wording), so neither imports the other back."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import fabric
import paramiko

from dflashops.core.errors import TransportError
from dflashops.transport.ssh_keys import RefuseUnknownHost, UnknownHostKey, translate_connect_error
from dflashops.transport.ssh_settings import SshSettings


def fabric_config() -> fabric.Config:
    path = os.environ.get("DFLASHOPS_SSH_CONFIG")
    return fabric.Config(runtime_ssh_path=path) if path else fabric.Config()


def build_connection(settings: SshSettings) -> fabric.Connection:
    """A Fabric Connection (not yet open) whose host-key policy refuses unknown keys, gateways included."""
    gateway = build_connection(settings.gateway) if settings.gateway else None
    connect_kwargs: dict[str, object] = {
        "banner_timeout": settings.connect_timeout,
        "auth_timeout": settings.connect_timeout,
        "channel_timeout": settings.connect_timeout,
    }
    if settings.identity_file:
        # An explicit identity means exactly that key (like IdentitiesOnly): a wrong key must fail
        # as an authentication error, not silently succeed with some other key from ~/.ssh.
        connect_kwargs.update(
            key_filename=[os.path.expanduser(settings.identity_file)], look_for_keys=False, allow_agent=False
        )
    conn = fabric.Connection(
        settings.host,
        user=settings.user,
        port=settings.port,
        config=fabric_config(),
        connect_timeout=max(1, int(settings.connect_timeout)),
        connect_kwargs=connect_kwargs,
        gateway=gateway,
    )
    # The inventory's gateway got its own policy from its own settings (recursion above); hops that
    # Fabric built from ssh_config's ProxyJump get this host's known_hosts and the same refusal.
    hop: object = conn
    while isinstance(hop, fabric.Connection):
        known = settings.known_hosts_path()
        if hop.ssh_config.get("userknownhostsfile") and not settings.known_hosts:
            known = Path(os.path.expanduser(hop.ssh_config["userknownhostsfile"].split()[0]))
        if known.exists():
            hop.client.load_system_host_keys(str(known))
        hop.client.set_missing_host_key_policy(
            RefuseUnknownHost(trust_name=settings.trust_name or settings.host, known_hosts=known)
        )
        hop = hop.gateway if gateway is None else None
    return conn


class _CaptureKey(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(hostname, key, hostname, Path())


def fetch_host_key(settings: SshSettings) -> tuple[str, paramiko.PKey]:
    """(known_hosts name, key) of the server, without authenticating. The gateway, if any, must be trusted."""
    # An empty known_hosts for this hop only, so the capturing policy sees its key even when it is known.
    conn = build_connection(dataclasses.replace(settings, known_hosts=os.devnull))
    conn.client.set_missing_host_key_policy(_CaptureKey())
    try:
        conn.open()
    except UnknownHostKey as captured:
        return captured.hostname, captured.key
    except Exception as exc:  # noqa: BLE001
        raise translate_connect_error(exc, settings, conn) from None
    finally:
        conn.close()
    raise TransportError(f"could not read the host key of {settings.host}")
