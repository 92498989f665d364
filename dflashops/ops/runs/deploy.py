"""deploy: sync the code, write run.json, launch the run, record it in the lineage.

Order matters for "refused means nothing changed": the name, the parent and the profile are checked
(lineage + target) before any byte is synced; the agent's `launch` claims the run directory with one
mkdir, so two deploys of the same name cannot both start. Secrets from the controller's environment
travel to the launched process on the agent's stdin only; run.json, the database and the dry-run plan
hold the redacted environment.
"""

from __future__ import annotations

from dflashops.core.errors import LaunchInterrupted
from dflashops.core.inventory import Profile, Target
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.launch import (
    DeployOutcome,
    DeployRequest,
    check_free_on_target,
    check_request,
    claim_name,
    launch_on,
)
from dflashops.ops.runs.nodes import deploy_nodes
from dflashops.ops.runs.supervise import after_launch


def deploy(invocation: Invocation, request: DeployRequest) -> DeployOutcome:
    targets, group = invocation.inventory.nodes(request.target)
    profile = invocation.inventory.profile(request.profile)
    if group is not None:  # a run on several targets: one job, one lineage row
        return deploy_nodes(invocation, request, targets, group, profile)
    target = targets[0]
    name = claim_name(invocation, request, target, profile, check_request(invocation, request, target, profile))
    try:
        if request.name == "+":
            check_free_on_target(invocation, target, name)
        return launch_named(invocation, request, target, profile, name)
    except BaseException as exc:
        if not invocation.dry_run:
            invocation.db.release(name)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, LaunchInterrupted):
            raise LaunchInterrupted(name) from None  # names the run, so the CLI can say whether it was launched
        raise


def launch_named(
    invocation: Invocation, request: DeployRequest, target: Target, profile: Profile, name: str
) -> DeployOutcome:
    """Sync, build the launch spec and launch the run `name` (already claimed), then fill in its lineage record."""
    outcome, spec = launch_on(invocation, request, target, profile, name)
    if not invocation.dry_run:
        invocation.db.fill(spec.record)
    outcome.supervisor = after_launch(invocation, request, target, profile, name, outcome.code_hash, outcome.release)
    return outcome
