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

from dflashops.core.errors import Conflict, UsageError
from dflashops.core.inventory import load_inventory


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trust",
        help="record a host's SSH key after showing its fingerprint",
        description="Fetch HOST's SSH host key, print its SHA256 fingerprint and record "
        "it in known_hosts (the inventory's file, else ~/.ssh/known_hosts).",
    )
    p.add_argument("host", help="inventory host or target name, or an ~/.ssh/config alias")
    p.add_argument("--yes", action="store_true", help="record without asking")
    p.add_argument("--fingerprint", metavar="SHA256:...", help="record only if the key has this fingerprint")
    p.set_defaults(func=handle_trust)


def handle_trust(args: argparse.Namespace) -> int:
    from dflashops.ops.doctor.trust import fetch_offer, record

    offer = fetch_offer(load_inventory(getattr(args, "inventory", None)), args.host)
    print(f"{offer.known_name} {offer.key_type} {offer.fingerprint}")
    if args.fingerprint and args.fingerprint != offer.fingerprint:
        raise Conflict(
            f"{offer.known_name} presented {offer.fingerprint}, not the expected {args.fingerprint}; nothing recorded",
            hint="someone may be in between, or the fingerprint was copied wrong",
        )
    if not (args.yes or args.fingerprint):
        if not sys.stdin.isatty():
            raise UsageError(
                "not recording without confirmation (stdin is not a terminal)",
                hint="compare the fingerprint above, then pass --yes or --fingerprint SHA256:...",
            )
        sys.stderr.write(f"record this key for {offer.known_name} in {offer.known_hosts}? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("not recorded", file=sys.stderr)
            return 1
    written = record(offer)
    print(f"{'recorded in' if written else 'already known in'} {offer.known_hosts}", file=sys.stderr)
    return 0
