"""`dflashops doctor [TARGET|--all] [--profile P] [--json]`: pre-flight checks, one ok/warn/fail line each.

The report is data (stdout); the exit status is non-zero when any check failed, so playbooks and CI can
gate on it. With --all, every target of the inventory is checked in parallel.
"""

from __future__ import annotations

import argparse
import sys

from dflashops.cli.common import emit_json, progress, use_colour
from dflashops.core.errors import UsageError
from dflashops.core.inventory import Inventory, load_inventory
from dflashops.ops.doctor.doctor import ChecksFailed, doctor, failed
from dflashops.ops.doctor.doctor_checks import Check

COLOURS = {"ok": "32", "warn": "33", "fail": "1;31", "skip": "2"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check that a target can run: host, container, GPUs, python, torch, disk, clock",
        description="Check TARGET (or --all targets) before a run: host reachable and host key known, container "
        "running, /dev/nvidia* passed through, nvidia-smi and its driver against the host's, the "
        "target python with torch/transformers/triton and the declared number of CUDA devices, tmux, "
        "free disk on the workspace and the compile cache, a writable workspace, the profiles' "
        "pass_env secrets in this shell (names only) and the clock. Exit status 1 when any check fails.",
    )
    p.add_argument("target", nargs="?", metavar="TARGET", help="target from the inventory (default: the default one)")
    p.add_argument("--all", action="store_true", help="check every target of the inventory, in parallel")
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="P",
        help="check the secrets this profile passes (repeatable; default: every profile's, as warnings)",
    )
    p.add_argument("--json", action="store_true", help="the checks as JSON on stdout")
    p.add_argument(
        "--all-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --all: seconds before a slow target is reported as timed out (default 300)",
    )
    p.set_defaults(func=handle_doctor)


def profiles_for(inventory: Inventory, names: list[str]) -> list:
    return [inventory.profile(name) for name in names] if names else list(inventory.profiles.values())


def check_target(inventory: Inventory, args: argparse.Namespace, name: str | None) -> tuple[str, list[Check]]:
    from dflashops.ops.invocation import Invocation

    invocation = Invocation(inventory)
    try:
        target = inventory.target(name)
        return target.name, doctor(
            invocation, target, profiles_for(inventory, args.profile), explicit_profile=bool(args.profile)
        )
    finally:
        invocation.close()


def render(target: str, checks: list[Check], width: int) -> list[str]:
    colour = use_colour()
    column = max(15, *(len(check.name) for check in checks))
    lines = []
    for check in checks:
        word = check.status.upper() if check.status in ("warn", "fail") else check.status
        shown = f"\x1b[{COLOURS[check.status]}m{word:<4}\x1b[0m" if colour else f"{word:<4}"
        lines.append(f"{target:<{width}}  {shown}  {check.name:<{column}} {check.detail}")
        if check.hint and check.status in ("warn", "fail"):
            lines.append(f"{'':<{width}}        {'':<{column}} hint: {check.hint}")
    return lines


def handle_doctor(args: argparse.Namespace) -> int:
    if args.all and args.target:
        raise UsageError("give a TARGET or --all, not both", hint="dflashops doctor --all")
    inventory = load_inventory(getattr(args, "inventory", None))
    profiles_for(inventory, args.profile)  # an unknown --profile is refused before anything runs
    if args.all:
        from dflashops.ops.fleet.fanout import fan_out

        progress(f"checking {len(inventory.targets)} target(s)...")
        results = fan_out(
            list(inventory.targets.values()),
            lambda t: check_target(inventory, args, t.name)[1],
            timeout=args.all_timeout,
        )
        reports = [
            (
                r.target,
                r.value if r.ok and r.value is not None else [Check("target", "fail", r.error or "no answer", r.hint)],
            )
            for r in results
        ]
    else:
        inventory.target(args.target)  # NotFound before any connection
        progress("checking (the torch import inside the target takes a few seconds)...")
        reports = [check_target(inventory, args, args.target)]
    if args.json:
        emit_json(
            {
                "targets": [
                    {"target": name, "failed": failed(checks), "checks": [c.to_dict() for c in checks]}
                    for name, checks in reports
                ]
            }
        )
    else:
        width = max(len(name) for name, _ in reports)
        for name, checks in reports:
            print("\n".join(render(name, checks, width)))
        sys.stdout.flush()
    bad = [(name, sum(c.status == "fail" for c in checks)) for name, checks in reports if failed(checks)]
    for name, checks in reports:
        counts = {s: sum(c.status == s for c in checks) for s in ("fail", "warn", "ok", "skip")}
        progress(
            f"{name}: {counts['fail']} failed, {counts['warn']} warning(s), {counts['ok']} ok, {counts['skip']} skipped"
        )
    if bad:
        raise ChecksFailed(
            f"doctor: {', '.join(f'{n} check(s) failed on {t}' for t, n in bad)}",
            hint="fix the FAIL lines (each has its hint), then run dflashops doctor again",
        )
    return 0
