"""Commands for a human at a terminal (`dflashops attach`): the argv that puts the user's terminal on a
command on the target. Paramiko cannot hand a real terminal over, so remote targets go through the system's
`ssh` client, with the same checks the ssh transport makes: host keys from the inventory's known_hosts only
(StrictHostKeyChecking=yes, never added silently), the identity file, port and jump hosts of the inventory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dflashops.core.errors import TransportError
from dflashops.core.shell import env_argv, join_argv
from dflashops.transport.ssh_settings import SshSettings, settings_for_host


def ssh_client_argv(settings: SshSettings, *, tty: bool) -> list[str]:
    """`ssh` options and destination for `settings` (no remote command). A gateway becomes a ProxyCommand built
    from the same rules, so the jump host's key is checked against its own known_hosts too."""
    argv = [
        "ssh",
        "-t" if tty else "-T",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={settings.known_hosts_path()}",
        "-o",
        f"ConnectTimeout={max(1, int(settings.connect_timeout))}",
        "-o",
        "BatchMode=yes",
    ]
    if settings.port:
        argv += ["-p", str(settings.port)]
    if settings.identity_file:
        argv += ["-i", os.path.expanduser(settings.identity_file), "-o", "IdentitiesOnly=yes"]
    if settings.gateway is not None:
        proxy = [*ssh_client_argv(settings.gateway, tty=False), "-W", "%h:%p"]
        argv += ["-o", "ProxyCommand=" + join_argv(proxy)]
    return argv + [f"{settings.user}@{settings.host}" if settings.user else settings.host]


def interactive_argv(
    target: object,
    argv: Sequence[str],
    *,
    hosts: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The local argv that runs `argv` on `target` (duck-typed inventory Target) with the user's terminal
    attached: as is for `local`; `ssh -t HOST [sudo -n] pct exec CTID -- env K=V argv` for `pct`;
    `ssh -t HOST env K=V argv` for `direct` and `host`. `env` values travel on the command line: never secrets."""
    kind, name = getattr(target, "kind"), getattr(target, "name")
    inner = [*env_argv(env), *argv] if env else list(argv)
    if kind == "local":
        return inner
    host = getattr(target, "host", None)
    if host is None:
        raise TransportError(f"target {name!r} ({kind}) names no host", hint="set `host:` for it in the inventory")
    if kind == "pct":
        sudo = ["sudo", "-n"] if getattr(host, "sudo", False) else []
        inner = [*sudo, "pct", "exec", str(getattr(target, "ctid")), "--", *inner]
    elif kind not in ("direct", "host"):
        raise TransportError(f"target {name!r} has kind {kind!r}, which is not a known kind")
    # The remote command is one string for the remote shell: quoted once, here, with shlex (join_argv).
    return [*ssh_client_argv(settings_for_host(host, hosts), tty=True), "--", join_argv(inner)]
