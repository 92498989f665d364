"""Opening an ssh connection: a Fabric Connection whose host-key policy refuses unknown keys (gateways
included), and `fetch_host_key` for `dflashops trust` (a bare key exchange, no login). Beside ssh.py (which
runs commands) and ssh_keys.py (keys, fingerprints, error wording), so neither imports the other back."""

from __future__ import annotations

import dataclasses
import os
import traceback
from pathlib import Path

import fabric
import paramiko

from dflashops.core.errors import TransportError
from dflashops.transport.ssh_keys import RefuseUnknownHost, UnknownHostKey, translate_connect_error
from dflashops.transport.ssh_settings import SshSettings

CLOSED_HERE = "dflashops_closed_here"  # set on a paramiko Transport this side closes: why (ssh.link_loss_reason)
ENDED_BY = "dflashops_ended_by"  # what ended a link that paramiko records no exception for (RecordedLink)


class RecordedLink(paramiko.Transport):
    """paramiko's Transport, keeping the two ends of a link that paramiko records no exception for, so a command
    that loses its link says why instead of "no cause recorded" (seen once in `doctor --all`, never reproduced):
    a DISCONNECT the server sent (paramiko only logs it; OpenSSH sends one on a protocol error), and a close() by
    code that did not mark why (`CLOSED_HERE`): then the closing call's place, three frames outside paramiko."""

    def _parse_disconnect(self, m: paramiko.Message) -> None:
        code, text = m.get_int(), m.get_text()
        setattr(self, ENDED_BY, f"the server disconnected (code {code}): {text}")
        m.rewind()  # the message's body from its start again: paramiko's own handler logs it
        super()._parse_disconnect(m)  # type: ignore[misc]  # private in the stubs, and the only hook there is

    def close(self) -> None:
        if self.is_active() and not getattr(self, CLOSED_HERE, None) and not getattr(self, ENDED_BY, None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/paramiko/" not in f.filename][-3:]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
            setattr(self, ENDED_BY, f"closed in this process, no cause given, by {where}")
        super().close()


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
        "transport_factory": RecordedLink,
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
