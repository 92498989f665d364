"""`dflashops provision TARGET [--dry-run] [--adopt]`: make or finish the target's Proxmox GPU container.

The container is declared by the target's `provision:` block (docs/provision.md). --dry-run prints the plan on
stdout (each command, then the config diff) and changes nothing; a run prints a progress line per step on
stderr and a summary line on stdout.
"""

from __future__ import annotations

import argparse

from dflashops.cli.common import progress
from dflashops.inventory import load_inventory


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "provision",
        help="create or finish a target's Proxmox GPU container (planned with --dry-run)",
        description="Bring TARGET's container to its inventory `provision:` block: create or clone it, pass its "
        "GPUs through, install the NVIDIA userspace of the host driver's version (no kernel module), python "
        "and the pinned packages, check nvidia-smi. A second run changes nothing. A container dflashops did "
        "not create is refused unless --adopt.",
    )
    p.add_argument("target", metavar="TARGET", help="a pct target with a provision: block")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the config diff; change nothing")
    p.add_argument("--adopt", action="store_true", help="take over an existing container dflashops did not create")
    p.set_defaults(func=handle_provision)


def handle_provision(args: argparse.Namespace) -> int:
    from dflashops.ops.provision.apply import provision

    target = load_inventory(getattr(args, "inventory", None)).target(args.target)
    outcome = provision(target, dry_run=args.dry_run, adopt=args.adopt, progress=progress)
    if args.dry_run:
        for line in outcome.lines:
            print(line)
        if not outcome.changed:
            print(f"# container {outcome.vmid} is as declared: nothing to change")
        return 0
    if outcome.changed:
        print(f"container {outcome.vmid} ({target.name}) provisioned: {len(outcome.changed)} changes")
    else:
        print(f"container {outcome.vmid} ({target.name}) is as declared: nothing changed")
    return 0
