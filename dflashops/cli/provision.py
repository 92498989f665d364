"""`dflashops provision TARGET [--dry-run] [--adopt]`: make or finish the target's Proxmox GPU container.

The container is declared by the target's `provision:` block (docs/provision.md). --dry-run prints the plan on
stdout (each command, then the config diff) and changes nothing; a run prints a progress line per step on
stderr and a summary line on stdout.
"""

from __future__ import annotations

import argparse
import sys

from dflashops.cli.common import progress
from dflashops.core.errors import UsageError
from dflashops.core.inventory import Inventory, Target, load_inventory


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "provision",
        help="create or finish a target's Proxmox GPU container (planned with --dry-run)",
        description="Bring TARGET's container to its inventory `provision:` block: create or clone it, pass its "
        "GPUs through, install the NVIDIA userspace of the host driver's version (no kernel module), python "
        "and the pinned packages, check nvidia-smi. A second run changes nothing. A container dflashops did "
        "not create is refused unless --adopt.",
    )
    p.add_argument("target", nargs="?", metavar="TARGET", help="a pct target with a provision: block")
    p.add_argument(
        "--clone",
        metavar="SOURCE",
        help="make another container like target SOURCE's (its provision: block) at --to HOST:VMID",
    )
    p.add_argument("--to", metavar="HOST:VMID", help="with --clone: an inventory host and a free vmid")
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

    inventory = load_inventory(getattr(args, "inventory", None))
    if args.clone is not None or args.to is not None:
        return handle_clone(args, inventory)
    if args.target is None:
        raise UsageError("name the target to provision", hint="dflashops provision TARGET [--dry-run]")
    target = inventory.target(args.target)
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


def handle_clone(args: argparse.Namespace, inventory: Inventory) -> int:
    """`--clone SOURCE --to HOST:VMID`: SOURCE's declared container, made again at HOST:VMID with a hostname of its
    own (and, being created, a fresh MAC); then the inventory entry to add for it (data, on stdout)."""
    from dflashops.ops.provision.apply import clone_target, provision

    if args.clone is None or args.to is None or args.target is not None or args.destroy:
        raise UsageError(
            "--clone SOURCE and --to HOST:VMID go together, without a TARGET or --destroy",
            hint="dflashops provision --clone ct300 --to pve1:301 [--dry-run]",
        )
    target = clone_target(inventory, args.clone, args.to)
    outcome = provision(target, dry_run=args.dry_run, adopt=False, repair=False, progress=progress)
    if args.dry_run:
        for line in outcome.lines:
            print(line)
        return 0
    print(f"container {outcome.vmid} ({target.name}) provisioned: {len(outcome.changed)} changes")
    print(f"# add it to {inventory.path.name} under targets: (and to a group, for runs on several targets)")
    print(inventory_entry(target, inventory.targets[args.clone]))
    return 0


def inventory_entry(target: Target, source: Target) -> str:
    """The new target as inventory YAML, SOURCE's settings with its own name, host, ctid and hostname."""
    import yaml

    assert target.provision is not None and source.provision is not None and target.host is not None
    block: dict = {"kind": "pct", "host": target.host.name, "ctid": target.ctid, "workspace": target.workspace}
    if target.python != "python3":
        block["python"] = target.python
    if target.gpus:
        block["gpus"] = list(target.gpus)
    spec = target.provision
    declared = {
        "template": spec.template, "clone": spec.clone, "storage": spec.storage, "disk_gb": spec.disk_gb,
        "cores": spec.cores, "memory_mb": spec.memory_mb, "swap_mb": spec.swap_mb or None, "network": spec.network,
        "hostname": spec.hostname, "gpus": "all" if spec.gpus is None else list(spec.gpus) or None,
        "unprivileged": None if spec.unprivileged else False, "driver_installer": spec.driver_installer,
        "packages": list(spec.packages) or None, "pip_args": list(spec.pip_args) or None,
    }  # fmt: skip
    block["provision"] = {key: value for key, value in declared.items() if value is not None}
    text = yaml.safe_dump({target.name: block}, sort_keys=False, default_flow_style=False, width=200)
    return "".join(f"  {line}\n" for line in text.splitlines())
