"""doctor: "will a run work on this target?", answered before a run fails ten minutes in.

Order: the host (reachable, host key known), the container (`pct status`), then one probe inside the target
(agent/doctor_probe.py, sent on stdin so it writes nothing there) whose facts ops/doctor/doctor_checks.py judges; a
later step is skipped when an earlier one failed (no container check on an unreachable host). Cost: for a
pct target three commands (host `true` + its nvidia-smi, `pct status`, the probe); the probe's import of
torch/transformers/triton dominates (~3-10 s).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dflashops.core.errors import DflashopsError
from dflashops.core.inventory import Profile, Target
from dflashops.ops.agent_client import _parse
from dflashops.ops.doctor.doctor_checks import Check, judge_probe, secret_checks
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases.sync import local_manifest, release_files

PROBE_SOURCE = Path(__file__).resolve().parents[2] / "agent" / "doctor_probe.py"  # dflashops/ops/doctor/ -> dflashops/
PROBE_TIMEOUT_S = 300.0  # the import probe inside has its own 180 s limit; this bounds a hung transport


def run_probe(
    invocation: Invocation, target: Target, python: str, *, imports: bool = True, code_hash: str = ""
) -> tuple[dict[str, Any] | None, float, str]:
    """(the probe's answer or None when `python` could not run it, controller time when it arrived, why not).
    `imports`: whether the probe tries the run's python's imports (not when that python could not run it)."""
    transport = invocation.agent(target).transport
    request = {
        "workspace": target.workspace,
        "python": target.python,
        "env": dict(target.env),
        "gpus": list(target.gpus),
        "import_timeout": 180,
        "imports": imports,
        "code_hash": code_hash,
        "compile_cache": target.compile_cache_root,
    }
    result = transport.run(
        [python, "-", "--json-args", json.dumps(request, sort_keys=True)],
        stdin=PROBE_SOURCE.read_bytes(),
        check=False,
        timeout=PROBE_TIMEOUT_S,
    )
    arrived = time.time()
    answer = _parse(result.stdout, result.stderr, "doctor", target.name)
    if not answer.get("ok"):
        reason = (result.stderr.strip().splitlines() or [answer.get("error", f"exit code {result.exit_code}")])[-1]
        return None, arrived, reason
    return answer, arrived, ""


def connect_checks(invocation: Invocation, target: Target) -> tuple[list[Check], bool]:
    """The host and container checks; (checks, whether the target can be entered at all)."""
    if target.kind == "local":
        return [Check("host", "ok", "local target: this machine, no ssh")], True
    transport = invocation.agent(target).transport
    host_transport = getattr(transport, "host", None) or transport
    checks: list[Check] = []
    host = target.host
    where = f"{host.address}:{host.port}" if host else target.name
    try:
        host_transport.run(["true"], timeout=60)
        checks.append(Check("host", "ok", f"{where} reachable, host key known"))
    except DflashopsError as exc:
        checks.append(Check("host", "fail", exc.message.splitlines()[0], exc.hint))
        return checks, False
    ensure = getattr(transport, "ensure_running", None)
    if target.kind == "pct" and ensure is not None:
        try:
            ensure()
            checks.append(Check("container", "ok", f"container {target.ctid} is running (pct status)"))
        except DflashopsError as exc:
            checks.append(Check("container", "fail", exc.message.splitlines()[0], exc.hint))
            return checks, False
    return checks, True


def host_driver(invocation: Invocation, target: Target) -> str | None:
    """The Proxmox host's driver version (pct targets: nvidia-smi on the host), None when it has none."""
    if target.kind != "pct":
        return None
    host_transport = getattr(invocation.agent(target).transport, "host", None)
    if host_transport is None:
        return None
    try:
        result = host_transport.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], check=False, timeout=60
        )
    except DflashopsError:
        return None
    versions = {line.strip() for line in result.stdout.splitlines() if line.strip()}
    return versions.pop() if result.exit_code == 0 and len(versions) == 1 else None


def doctor(
    invocation: Invocation,
    target: Target,
    profiles: list[Profile],
    *,
    explicit_profile: bool = False,
    environ: dict[str, str] | None = None,
) -> list[Check]:
    """Every check for `target`, in order. `profiles`: whose pass_env secrets to look for in this shell."""
    checks, reachable = connect_checks(invocation, target)
    if not reachable:
        checks.append(Check("target", "skip", "the checks inside the target need the steps above"))
        return checks
    profile = profiles[0] if explicit_profile and profiles else None
    files = release_files(profile.files, invocation.inventory.root, profile.packages) if profile else release_files()
    code_hash = local_manifest(files)[0]  # the code a deploy would send now: is the target's cache warm for it?
    answer, arrived, why = run_probe(invocation, target, target.python, code_hash=code_hash)
    python_check = None
    if answer is None and target.python != "python3":
        python_check = Check(
            "python",
            "fail",
            f"{target.python} cannot run: {why}",
            f"install Python there, or fix `python:` of target {target.name} in the inventory",
        )
        # The other checks still run, with the target's python3; the ones that need the run's python are
        # skipped (doctor_checks.python_skips), so the probe does not start it again only to fail (or hang).
        answer, arrived, _ = run_probe(invocation, target, "python3", imports=False, code_hash=code_hash)
    if answer is None:
        checks.append(
            python_check
            or Check("python", "fail", f"{target.python} cannot run: {why}", "install python3 in the target")
        )
        return checks
    checks += judge_probe(
        target, answer, arrived, host_driver=host_driver(invocation, target), python_check=python_check
    )
    checks += secret_checks(profiles, environ if environ is not None else dict(os.environ), explicit_profile, target)
    return checks


class ChecksFailed(DflashopsError):
    """At least one doctor check failed (the report was printed first)."""

    exit_code = 1


def failed(checks: list[Check]) -> bool:
    return any(check.status == "fail" for check in checks)
