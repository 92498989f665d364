"""`dflashops provision TARGET [--dry-run] [--adopt]`: make or finish the target's Proxmox GPU container.

The container is declared by the target's `provision:` block (docs/provision.md). --dry-run prints the plan on
stdout (each command, then the config diff) and changes nothing; a run prints a progress line per step on
stderr and a summary line on stdout.
"""

from __future__ import annotations

import argparse
import sys

from dflashops.cli.common import progress
from dflashops.errors import UsageError
from dflashops.inventory import Target, load_inventory


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
    p.add_argument(
        "--repair",
        action="store_true",
        help="after a host driver upgrade: re-install the NVIDIA userspace of the new version (no run may be active)",
    )
    p.add_argument("--destroy", action="store_true", help="stop and destroy the container (its name typed back)")
    p.add_argument("--yes-destroy", metavar="NAME", help="with --destroy: the container's name, typed back")
    p.set_defaults(func=handle_provision)


def handle_provision(args: argparse.Namespace) -> int:
    from dflashops.ops.provision.apply import provision

    target = load_inventory(getattr(args, "inventory", None)).target(args.target)
    if args.yes_destroy is not None and not args.destroy:
        raise UsageError("--yes-destroy goes with --destroy", hint=f"dflashops provision {target.name} --destroy ...")
    if args.destroy:
        return handle_destroy(args, target)
    outcome = provision(target, dry_run=args.dry_run, adopt=args.adopt, repair=args.repair, progress=progress)
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


def handle_destroy(args: argparse.Namespace, target: Target) -> int:
    """The name is typed back: --yes-destroy NAME, or asked for on a terminal (never assumed)."""
    from dflashops.ops.provision.retire import destroy

    typed = args.yes_destroy
    if typed is None and not args.dry_run and sys.stdin.isatty():
        sys.stderr.write(f"destroy container {target.ctid} of target {target.name}? type its name to confirm: ")
        sys.stderr.flush()
        typed = sys.stdin.readline().strip()
    name, commands = destroy(target, typed_name=typed, adopt=args.adopt, dry_run=args.dry_run, progress=progress)
    if args.dry_run:
        for command in commands:
            print(command)
        if typed != name:
            print(f"# to run it: dflashops provision {target.name} --destroy --yes-destroy {name}")
    else:
        print(f"container {target.ctid} ({target.name}) destroyed")
    return 0
