"""Host keys and connect errors for the ssh transport: refuse unknown keys, fingerprints, `trust`.

- `RefuseUnknownHost`: paramiko policy raising `UnknownHostKey` (carrying the key) instead of adding it.
- `fingerprint(key)`: OpenSSH's `SHA256:<base64>` form, so it can be compared with `ssh-keygen -lf`.
- (`fetch_host_key` lives in ssh_connect.py:) the server's key from a bare key exchange (no authentication), through the
  gateway when there is one; used by `dflashops trust` to show the key before recording it.
- `record_host_key(...)`: appends `[host]:port type base64` to known_hosts (0600, directory 0700).
- `translate_connect_error(exc, settings, conn)`: every way `connect` fails -> one `TransportError`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from dflashops.core.errors import Conflict, TransportError
from dflashops.transport.key_files import damage

if TYPE_CHECKING:
    import fabric

    from dflashops.transport.ssh_settings import SshSettings


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey, trust_name: str, known_hosts: Path) -> None:
        super().__init__(f"unknown host key for {hostname}")
        self.hostname, self.key, self.trust_name, self.known_hosts = hostname, key, trust_name, known_hosts


class RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    """Refuse any host whose key is not in known_hosts (the opposite of Fabric's AutoAddPolicy)."""

    def __init__(self, trust_name: str, known_hosts: Path) -> None:
        self.trust_name, self.known_hosts = trust_name, known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(hostname, key, self.trust_name, self.known_hosts)


def record_host_key(known_hosts: Path, hostname: str, key: paramiko.PKey) -> bool:
    """Append the key unless an identical line exists (False then). A DIFFERENT key of the same type
    already recorded for the host raises Conflict: replacing a known key is a human's decision."""
    known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys = paramiko.HostKeys(str(known_hosts)) if known_hosts.exists() else paramiko.HostKeys()
    existing = keys.lookup(hostname)
    old = existing.get(key.get_name()) if existing is not None else None
    if old == key:
        return False
    if old is not None:
        raise Conflict(
            f"{known_hosts} already has a DIFFERENT {key.get_name()} key for {hostname} "
            f"({fingerprint(old)}); nothing recorded",
            hint=f"if the host was really reinstalled: ssh-keygen -R '{hostname}' -f {known_hosts}",
        )
    line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
    fd = os.open(known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as handle:
        handle.write(line)
    return True


def check_identity_files(settings: SshSettings) -> None:
    """Refuse, before connecting, an inventory `identity_file` (this host's or a gateway's) that is missing,
    unreadable, not a private key or a damaged one (key_files.py), naming the file: paramiko would report a
    missing or damaged file as a failed handshake ("is it an ssh server?") and a garbage file as a
    UnicodeDecodeError."""
    hop: SshSettings | None = settings
    while hop is not None:
        if hop.identity_file:
            check_identity_file(Path(os.path.expanduser(hop.identity_file)), hop.trust_name or hop.host)
        hop = hop.gateway


def check_identity_file(path: Path, host: str) -> None:
    fix = f"set identity_file of host {host} in the inventory to your private key (e.g. ~/.ssh/id_ed25519)"
    if not path.exists():
        raise TransportError(f"identity file {path} does not exist (host {host})", hint=fix)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TransportError(
            f"cannot read identity file {path} (host {host}): {exc.strerror}",
            hint=f"make it readable for you (chmod 600 {path}), or {fix}",
        ) from None
    try:
        paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        return  # an encrypted key: the connection asks the agent / reports the authentication failure
    except Exception as exc:  # noqa: BLE001 - every loader failure means the same to the user
        if b"PRIVATE KEY-----" not in data:
            kind = "a public key" if data.lstrip().startswith((b"ssh-", b"ecdsa-")) else "not a private key"
            raise TransportError(
                f"identity file {path} (host {host}) is {kind} ({type(exc).__name__})",
                hint=f"point identity_file at the private key, not the .pub; check a key with: ssh-keygen -y -f {path}",
            ) from None
        # Armoured: a body that is whole is a key paramiko cannot load only for its cipher (encrypted keys fail
        # as TypeError here too) or its type (DSA, PKCS#8 ed25519): the connection says what it makes of it.
        # A body that is not base64, or cut short, would reach the server as a failed "ssh handshake".
        if problem := damage(data):
            raise TransportError(
                f"identity file {path} (host {host}) is damaged: {problem}",
                hint=f"copy the key again or point identity_file at another one; check a key with: "
                f"ssh-keygen -y -f {path}",
            ) from None


def translate_connect_error(
    exc: BaseException, settings: SshSettings, conn: fabric.Connection | None = None
) -> TransportError:
    """One line a user can act on, for every failure of opening a connection."""
    where = f"{conn.user}@{conn.host}:{conn.port}" if conn is not None else settings.host
    name = settings.trust_name or settings.host
    timeout = settings.connect_timeout
    if isinstance(exc, UnknownHostKey):
        return TransportError(
            f"host key of {exc.hostname} is not known (not in {exc.known_hosts}); "
            f"its {exc.key.get_name()} fingerprint is {fingerprint(exc.key)}",
            hint=f"check the fingerprint out of band, then run: dflashops trust {name}",
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return TransportError(
            f"host key of {exc.hostname} CHANGED: got {fingerprint(exc.key)}, known_hosts has "
            f"{fingerprint(exc.expected_key)} (reinstalled host, or someone in between)",
            hint=f"verify the new key out of band, remove the old line from known_hosts, then: dflashops trust {name}",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return TransportError(
            f"authentication failed for {where}: {exc}",
            hint="check identity_file in the inventory (or IdentityFile in ~/.ssh/config) and that its "
            "public key is in the server's authorized_keys",
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return TransportError(
            f"cannot reach {where}: no answer within {timeout:g}s (connect timeout)",
            hint="is the host up and the address/port right?",
        )
    if isinstance(exc, socket.gaierror):
        return TransportError(
            f"cannot resolve host {conn.host if conn else settings.host!r}: {exc.strerror}",
            hint="check the address in the inventory or the alias in ~/.ssh/config",
        )
    if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
        return TransportError(
            f"cannot reach {where}: connection refused", hint="is sshd running there, and is the port right?"
        )
    if isinstance(exc, (UnicodeDecodeError, ValueError)) and settings.identity_file:
        return TransportError(
            f"cannot use identity file {settings.identity_file} for {where}: {type(exc).__name__}",
            hint=f"check the key with: ssh-keygen -y -f {settings.identity_file}",
        )
    if isinstance(exc, (paramiko.SSHException, EOFError, OSError)):
        text = str(exc) or type(exc).__name__
        return TransportError(
            f"ssh handshake with {where} failed: {text}",
            hint="the server closed the connection; is it an ssh server, and reachable?",
        )
    return TransportError(
        f"cannot connect to {where}: {type(exc).__name__}: {exc}",
        hint="check the host's address, port, user and identity_file in the inventory",
    )
