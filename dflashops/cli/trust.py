"""`dflashops trust HOST`: show a host's key fingerprint and record it in known_hosts.

The ssh transport refuses hosts whose key is not in known_hosts; this is the one deliberate way to add
one. HOST is an inventory host, a target (its host; for `direct`/`host` targets the machine itself), or
an ~/.ssh/config alias. The key is fetched by a bare key exchange (no login), printed with its SHA256
fingerprint (compare it with `ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` on the host), and recorded
after a yes on the terminal, or with `--yes`, or when it equals `--fingerprint SHA256:...` (scripts).
A known host whose key CHANGED is refused: removing the old line is a decision for a human.
"""

from __future__ import annotations

import argparse
import sys

from typing import TYPE_CHECKING

from dflashops.errors import Conflict, UsageError
from dflashops.inventory import load_inventory

if TYPE_CHECKING:
    from dflashops.transport.ssh_settings import SshSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trust", help="record a host's SSH key after showing its fingerprint",
                              description="Fetch HOST's SSH host key, print its SHA256 fingerprint and record "
                                          "it in known_hosts (the inventory's file, else ~/.ssh/known_hosts).")
    p.add_argument("host", help="inventory host or target name, or an ~/.ssh/config alias")
    p.add_argument("--yes", action="store_true", help="record without asking")
    p.add_argument("--fingerprint", metavar="SHA256:...", help="record only if the key has this fingerprint")
    p.set_defaults(func=handle_trust)


def settings_for(name: str, inventory_path: str | None) -> "SshSettings":
    from dflashops.transport.ssh_settings import SshSettings, settings_for_host

    inventory = load_inventory(inventory_path)
    if name in inventory.hosts:
        return settings_for_host(inventory.hosts[name], inventory.hosts)
    if name in inventory.targets and inventory.targets[name].host is not None:
        host = inventory.targets[name].host
        return settings_for_host(host, inventory.hosts)
    if name in inventory.targets:
        raise UsageError(f"target {name!r} is local: there is no host key to trust")
    return SshSettings(host=name, trust_name=name)  # an ssh_config alias or a bare address


def handle_trust(args: argparse.Namespace) -> int:
    # Imported here: fabric/paramiko cost ~0.2 s of start-up that every other verb would pay otherwise.
    from dflashops.transport.ssh_keys import fetch_host_key, fingerprint, record_host_key

    settings = settings_for(args.host, getattr(args, "inventory", None))
    known_name, key = fetch_host_key(settings)
    printed = fingerprint(key)
    print(f"{known_name} {key.get_name()} {printed}")
    known_hosts = settings.known_hosts_path()
    if args.fingerprint and args.fingerprint != printed:
        raise Conflict(f"{known_name} presented {printed}, not the expected {args.fingerprint}; nothing recorded",
                       hint="someone may be in between, or the fingerprint was copied wrong")
    if not (args.yes or args.fingerprint):
        if not sys.stdin.isatty():
            raise UsageError("not recording without confirmation (stdin is not a terminal)",
                             hint="compare the fingerprint above, then pass --yes or --fingerprint SHA256:...")
        sys.stderr.write(f"record this key for {known_name} in {known_hosts}? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("not recorded", file=sys.stderr)
            return 1
    written = record_host_key(known_hosts, known_name, key)
    print(f"{'recorded in' if written else 'already known in'} {known_hosts}", file=sys.stderr)
    return 0

