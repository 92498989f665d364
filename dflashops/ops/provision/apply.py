"""Plan and apply a target's container: `dflashops provision TARGET [--dry-run] [--adopt]`.

Order: read the host -> plan the host steps (refusals happen here, before anything changes) -> run them ->
read the running container -> plan and run its steps -> check `nvidia-smi` -> tag the container finished.
A container is tagged `dflashops-unfinished` from its first change to the last step, so a run that fails or is
killed in between leaves a container the next run recognises as its own and finishes (or `pct destroy` removes):
it is never left half-made without a word. A second run finds nothing to change and says so.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dflashops.core.errors import CommandFailed, Conflict, DflashopsError, UsageError
from dflashops.core.inventory import Inventory, Target
from dflashops.core.inventory_provision import ProvisionSpec
from dflashops.core.shell import join_argv
from dflashops.ops.provision import config as cfg
from dflashops.ops.provision.facts import read_container, read_host
from dflashops.ops.provision.lock import provision_lock
from dflashops.ops.provision.plan import ContainerFacts, Plan, Step, plan_host
from dflashops.ops.provision.plan_container import finish_step, plan_container
from dflashops.ops.provision.retire import refuse_under_runs
from dflashops.transport import open_transport
from dflashops.transport.base import Transport
from dflashops.transport.pct import PctTransport

Progress = Callable[[str], None]


class ProvisionFailed(DflashopsError):
    """A step of an applied plan failed; the container keeps its unfinished tag for the next run."""

    exit_code = 6


@dataclass
class Outcome:
    vmid: int
    changed: list[str] = field(default_factory=list)  # titles of the steps that changed something
    lines: list[str] = field(default_factory=list)  # dry run: the plan as text (commands, then the config diff)


def spec_of(target: Target) -> ProvisionSpec:
    if target.provision is None:
        raise UsageError(
            f"target {target.name!r} has no provision: block",
            hint="declare the container under the target in the inventory (docs/provision.md)",
        )
    return target.provision


def provision(
    target: Target, *, dry_run: bool = False, adopt: bool = False, repair: bool = False, progress: Progress
) -> Outcome:
    spec = spec_of(target)
    transport = open_transport(target)
    try:
        assert isinstance(transport, PctTransport) and transport.host is not None
        if dry_run:  # reading only: no lock, and a plan is shown even while another run holds it
            return _provision(
                target, spec, transport, transport.host, dry_run=True, adopt=adopt, repair=repair, progress=progress
            )
        with provision_lock(transport.host, int(target.ctid or 0), progress):
            return _provision(
                target, spec, transport, transport.host, dry_run=False, adopt=adopt, repair=repair, progress=progress
            )
    finally:
        transport.close()


def _provision(
    target: Target,
    spec: ProvisionSpec,
    ct: PctTransport,
    host: Transport,
    *,
    dry_run: bool,
    adopt: bool,
    repair: bool,
    progress: Progress,
) -> Outcome:
    sudo = ["sudo", "-n"] if ct.sudo else []
    progress(f"reading {host.name}: driver, GPU device nodes, containers")
    facts = read_host(host, ct.pct_argv, target, spec, sudo)
    plan = plan_host(target, spec, facts, adopt=adopt)
    outcome = Outcome(vmid=plan.vmid)
    for note in plan.notes:
        progress(note)
    if dry_run:
        running = plan.vmid in facts.running  # config changes to a running one were refused above
        ct_facts = read_container(ct, spec) if running else ContainerFacts(python3=bool(plan.before))
        if running:
            check_drift(target, facts.driver_version, ct_facts, ct, repair=repair)
        inside = plan_container(target, spec, facts, ct_facts)
        last = finish_step(plan.vmid, cfg.parse_config("\n".join(plan.after)))
        outcome.lines = _dry_run_text(plan, [*plan.steps, *inside, *([last] if last else [])], ct, sudo)
        outcome.changed = [s.title for s in [*plan.changes, *inside, *([last] if last else [])] if not s.check]
        return outcome
    total = len(plan.steps)
    for number, step in enumerate(plan.steps, 1):
        _apply(step, number, total, target, ct, host, sudo, progress, outcome)
    try:
        ct_facts = read_container(ct, spec)
        check_drift(target, facts.driver_version, ct_facts, ct, repair=repair)
        inside = plan_container(target, spec, facts, ct_facts)
    except DflashopsError as exc:
        if not outcome.changed and cfg.UNFINISHED_TAG not in cfg.tags(cfg.parse_config("\n".join(plan.before))):
            raise
        # The host steps ran (or an earlier run's did): say that the container waits, unfinished, for the fix.
        exc.hint = f"{exc.hint}; then provision again to finish container {plan.vmid} (tagged {cfg.UNFINISHED_TAG})"
        raise
    for number, step in enumerate(inside, 1):
        _apply(step, number, len(inside), target, ct, host, sudo, progress, outcome)
    if inside and inside[-1].check:
        _check_gpus(target, spec, facts.gpu_nodes(), ct)
    shown = host.run(ct.pct_argv("config", str(plan.vmid)), check=False)
    last = finish_step(plan.vmid, cfg.parse_config(shown.stdout))
    if last is not None:
        _apply(last, 1, 1, target, ct, host, sudo, progress, outcome)
    return outcome


def check_drift(
    target: Target, host_version: str | None, ct_facts: ContainerFacts, ct: PctTransport, *, repair: bool
) -> None:
    """A container whose NVIDIA userspace is another version than the host's driver (a host driver upgrade):
    re-installed only with --repair, and never under an active run."""
    have = ct_facts.nvidia_version
    if have is None or host_version is None or have == host_version:
        return
    if not repair:
        raise Conflict(
            f"driver drift in container {target.ctid}: its NVIDIA userspace is {have}, the host's driver {host_version}",
            hint=f"`dflashops provision {target.name} --repair` installs {host_version} there (no run may be active)",
        )
    refuse_under_runs(target, ct, f"re-installing the NVIDIA userspace ({have} -> {host_version})")


def _apply(
    step: Step,
    number: int,
    total: int,
    target: Target,
    ct: PctTransport,
    host: Transport,
    sudo: list[str],
    progress: Progress,
    outcome: Outcome,
) -> None:
    progress(f"[{number}/{total}] {step.title}")
    if step.where == "manual":
        raise ProvisionFailed(
            f"{host.name}'s pct has no devN option: add {len(step.lines)} GPU lines to /etc/pve/lxc/{outcome.vmid}.conf "
            "by hand (the container stays tagged dflashops-unfinished)",
            hint=f"`dflashops provision {target.name} --dry-run` prints them; add them, then provision again",
        )
    try:
        if step.where == "host":
            host.run([*sudo, *step.argv], timeout=1800)
        else:
            ct.run(step.argv, timeout=3600)
    except CommandFailed as exc:
        raise _failure(step, exc, target, outcome.vmid) from None
    if not step.check:
        outcome.changed.append(step.title)


def _failure(step: Step, exc: CommandFailed, target: Target, vmid: int) -> ProvisionFailed:
    words = (exc.result.stderr.strip() or exc.result.stdout.strip()).splitlines()
    last = words[-1] if words else f"exit code {exc.result.exit_code}"
    hint = (
        f"container {vmid} is tagged dflashops-unfinished: fix the cause, then `dflashops provision {target.name}` "
        "finishes it"
    )
    if "already exists" in last:
        hint = "another container took this vmid meanwhile: give the target another ctid (`pct list` shows them)"
    elif "insufficient free space" in last:
        hint = "free space on the storage (`pvesm status` shows it), or set provision.storage / disk_gb"
    elif step.argv[:2] == ("pct", "create"):
        hint = "nothing was created (pct create removes what it started); fix the cause and provision again"
    return ProvisionFailed(f"{step.title} failed on {exc.result.target}: {last}", hint=hint)


def _check_gpus(target: Target, spec: ProvisionSpec, nodes: dict, ct: PctTransport) -> None:
    wanted = len(nodes) if spec.gpus is None else len(spec.gpus)
    listed = ct.run(["nvidia-smi", "-L"], check=False)
    found = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    if not listed.ok or found != wanted:
        said = (listed.stdout.strip() or listed.stderr.strip()).splitlines()
        raise ProvisionFailed(
            f"nvidia-smi in container {target.ctid} lists {found} GPUs, not {wanted}"
            + (f": {said[0]}" if said and not listed.ok else ""),
            hint="`pct config` on the host shows the dev lines; `dflashops doctor " + target.name + "` checks more",
        )


def _dry_run_text(plan: Plan, steps: list[Step], ct: PctTransport, sudo: list[str]) -> list[str]:
    lines: list[str] = []
    for step in steps:
        if step.where == "host":
            command = join_argv([*sudo, *step.argv])
        elif step.where == "container":
            command = join_argv([*sudo, "pct", "exec", str(plan.vmid), "--", *step.argv])
        else:
            command = f"# add to /etc/pve/lxc/{plan.vmid}.conf by hand: " + "; ".join(step.lines)
        lines.append(f"{command}{'   # check' if step.check else ''}")
    path = f"/etc/pve/lxc/{plan.vmid}.conf"
    diff = list(
        difflib.unified_diff(
            plan.before, plan.after, fromfile=path if plan.before else "/dev/null", tofile=path, lineterm="", n=99
        )
    )
    if diff:
        lines += ["", *diff]
    return lines


def clone_target(inventory: Inventory, source: str, to: str) -> Target:
    """The target `--clone SOURCE --to HOST:VMID` makes: SOURCE's with another host, vmid, name and hostname
    (`<source>-<vmid>`). The container is made from the same template (or template container), with the same
    GPU, driver and package checks; the host's own GPU rule holds (a GPU SOURCE holds there is busy)."""
    original = inventory.target(source)
    spec = spec_of(original)
    host_name, _, vmid_text = to.partition(":")
    if host_name not in inventory.hosts or not vmid_text.isdigit() or int(vmid_text) < 100:
        raise UsageError(
            f"--to {to!r}: expected HOST:VMID with an inventory host and a vmid from 100",
            hint=f"hosts: {', '.join(sorted(inventory.hosts)) or '(none)'}; e.g. --to {next(iter(inventory.hosts), 'pve1')}:301",
        )
    vmid = int(vmid_text)
    name = f"{original.name}-{vmid}"
    if name in inventory.targets or any(
        t.ctid == vmid and t.host is not None and t.host.name == host_name for t in inventory.targets.values()
    ):
        raise Conflict(
            f"{host_name}:{vmid} (or the name {name}) is a target of the inventory already",
            hint="choose another vmid: a clone is a new container",
        )
    return replace(
        original,
        name=name,
        host=inventory.hosts[host_name],
        ctid=vmid,
        provision=replace(spec, hostname=re.sub(r"[^A-Za-z0-9-]", "-", name)[:63].strip("-") or f"ct{vmid}"),
    )
