"""launch: one run on one target. The request, its checks, the name's claim, the launch spec, the launch.

The layers above call these in the order that keeps "refused means nothing changed": `check_request` (name,
parent, launcher, extra arguments: read-only), `claim_name` (the lineage row, before any byte is synced),
`launch_on` (sync, then the agent's `launch`, which claims the run directory with one mkdir, so two launches
of the same name cannot both start). Secrets from the controller's environment travel to the launched process
on the agent's stdin only; run.json, the database and the dry-run plan hold the redacted environment.
Callers: ops/runs/deploy.py (a run on one target), ops/runs/nodes.py (one launch per node), ops/runs/restart.py and
ops/runs/supervise.py (the spec of a child run). Nothing here starts a supervisor or records the launched run:
whoever launched does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from dflashops.agent.answers import ClearCacheAnswer, LaunchAnswer, PreflightAnswer, StatusAnswer
from dflashops.agent.common import LAUNCHERS  # the agent starts runs; its list is the list
from dflashops.agent.protocol import LaunchRequest, PreflightRequest, StatusRequest
from dflashops.core.errors import Conflict, UsageError
from dflashops.core.inventory import Profile, Target
from dflashops.core.shell import validate_name
from dflashops.lineage import RunRecord, next_name, redact_env, wandb_env
from dflashops.lineage.record import REDACTED, utc_now_iso
from dflashops.ops.agent_client import Agent
from dflashops.ops.releases.sync import sync
from dflashops.ops.runs.extra_args import managed_flags, merge_extra_args
from dflashops.ops.session import Session

# Passed through from the controller's environment when set, whatever the profile says.
DEFAULT_PASS_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
PLACEHOLDER_RE = re.compile(r"\{([a-z_]+)\}")


@dataclass
class DeployRequest:
    target: str | None
    profile: str
    name: str | None = None  # None: <profile>-<UTC time>; "+": next name after `parent`
    parent: str | None = None
    note: str = ""
    launcher: str = "tmux"
    clear_cache: bool = False
    extra_args: list[str] = field(default_factory=list)
    checkpoint: str | None = None  # resume from this checkpoint (profile's resume_args)
    node: NodePlace | None = None  # this target's place in a run on several targets (ops/runs/nodes.py)
    # The new code and flags prove they can start in the target before anything is launched or stopped (the
    # agent's preflight_release: compile, `python -m trainer check`); False: --skip-preflight.
    preflight: bool = True


@dataclass(frozen=True)
class NodePlace:
    """Where one target stands in a run on several targets: the values of the torchrun placeholders."""

    rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    targets: tuple[str, ...] = ()  # every node's target, node 0 first (empty: a run on one target)

    def values(self, name: str) -> dict[str, str]:
        return {
            "nnodes": str(self.nnodes),
            "node_rank": str(self.rank),
            "master_addr": self.master_addr,
            "master_port": str(self.master_port),
            "rdzv_id": name,
        }


@dataclass
class DeployOutcome:
    name: str
    target: str
    run_dir: str
    code_hash: str
    release: str
    pgid: int | None
    uploaded: int
    cache_cleared: ClearCacheAnswer | None  # the agent's clear-cache answer: what went (folders, bytes, files)
    supervisor: dict | None = None  # the in-target supervisor's start answer (ops/runs/supervise.py), if any
    preflight: dict | None = None  # what the agent's pre-flight checked (None: skipped, or a dry run)
    standby: bool = False  # started by a standby interpreter of the target (agent/standby.py): no imports to wait for
    nodes: list[DeployOutcome] = field(default_factory=list)  # a run on several targets: each node's, node 0 first


def expand(template: str, values: dict[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match.group(1) not in values:
            raise UsageError(
                f"unknown placeholder {{{match.group(1)}}} in profile argument {template!r}",
                hint=f"placeholders: {', '.join('{' + k + '}' for k in sorted(values))}",
            )
        return values[match.group(1)]

    return PLACEHOLDER_RE.sub(substitute, template)


def choose_name(invocation: Session, request: DeployRequest) -> str:
    if request.name == "+":
        if not request.parent:
            raise UsageError(
                "--name + derives the name from the parent run, but no --parent was given",
                hint="add --parent RUN, or give an explicit --name",
            )
        return next_name(request.parent, invocation.db.names())
    name = request.name
    if name is None:
        name = f"{request.profile}-{utc_now_iso().replace(':', '').replace('-', '')[:15]}"
    return validate_name(name, what="run name")


def run_argv(profile: Profile, target: Target, values: dict[str, str], request: DeployRequest) -> list[str]:
    argv = merge_extra_args(
        [expand(arg, values) for arg in profile.argv],
        request.extra_args,
        managed_flags(profile.argv, profile.resume_args),
        profile.name,
    )
    if request.checkpoint:
        if not profile.resume_args:
            raise UsageError(
                f"profile {profile.name!r} has no resume_args, so it cannot resume",
                hint="add resume_args: [--resume-from, '{checkpoint}'] to the profile, or use --fresh",
            )
        argv += [expand(arg, {**values, "checkpoint": request.checkpoint}) for arg in profile.resume_args]
    return argv


@dataclass
class LaunchSpec:
    """Everything a launch sends, built before anything runs: `args` go on the command line (or the
    request), `env` (with secrets) only on stdin; `record` is the lineage row (redacted environment)."""

    name: str
    run_dir: str
    record: RunRecord
    args: LaunchRequest  # without `env`
    env: dict[str, str]


def launch_spec(
    invocation: Session,
    request: DeployRequest,
    target: Target,
    profile: Profile,
    name: str,
    code_hash: str,
    release_path: str,
) -> LaunchSpec:
    run_dir = f"{target.workspace}/runs/{name}"
    # One compile cache per target, shared by every code version (torch's caches are content-addressed); the
    # trainer names its folder inside by python/torch/triton/GPU (trainer/core/compile_cache.py).
    cache_root = target.compile_cache_root
    place = request.node or NodePlace()
    values = {
        "python": target.python,
        "release": release_path,
        "run_dir": run_dir,
        "workspace": target.workspace,
        "name": name,
        "gpus": ",".join(map(str, target.gpus)),
        **place.values(name),
    }
    argv = run_argv(profile, target, values, request)
    root = invocation.db.root(request.parent) if request.parent else name
    env = {
        **target.env,
        **profile.env,
        **wandb_env(name, request.parent, request.note, root),
        "PYTHONPATH": release_path,
        "TRAINER_COMPILE_CACHE_ROOT": cache_root,
        "PYTHONUNBUFFERED": "1",
    }
    if target.gpus:
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, target.gpus)))
    secrets = {key: os.environ[key] for key in (*DEFAULT_PASS_ENV, *profile.pass_env) if key in os.environ}
    # Every pass_env variable is a secret whatever its name (DB_PASS, OPENAI_KEY): stored and shown by name only.
    shown_env = {**redact_env(env), **{key: REDACTED for key in secrets}}
    record = RunRecord(
        name=name,
        parent=request.parent,
        note=request.note,
        code_hash=code_hash,
        argv=argv,
        env=shown_env,
        target=target.name,
        gpus=list(target.gpus),
        launcher=request.launcher,
        session=name,
        profile=profile.name,
        extra={
            "run_dir": run_dir,
            "release": release_path,
            "extra_args": list(request.extra_args),
            "resumed_from": request.checkpoint,
            **({"node": place.rank, "node_targets": list(place.targets)} if place.targets else {}),
        },
    )
    run_json = {**record.to_dict(), "hypothesis": request.note, "release": release_path, "run_dir": run_dir}
    args = LaunchRequest(
        workspace=target.workspace,
        name=name,
        argv=argv,
        cwd=run_dir,
        launcher=request.launcher,
        run_json=run_json,
        standby=target.standby,
        standby_idle_s=target.standby_idle_s,
        secret_keys=sorted(secrets),  # names only: kept out of a standby interpreter's files and environment
        preflight=request.preflight,
        # The profile's `check:` (a job other than the trainer): run by the agent's pre-flight in the new release,
        # with the run's `--` extra arguments appended (agent/preflight.py profile_check).
        check={
            "argv": [expand(arg, values) for arg in profile.check] + list(request.extra_args),
            "timeout": profile.check_timeout,
            "profile": profile.name,
        }
        if profile.check
        else None,
        clear_cache=request.clear_cache,  # after the pre-flight: a refused launch leaves the cache warm
        compile_cache=cache_root,
    )
    return LaunchSpec(name=name, run_dir=run_dir, record=record, args=args, env={**env, **secrets})


def check_request(
    invocation: Session, request: DeployRequest, target: Target, profile: Profile, *, ask_target: bool = True
) -> str:
    """Every refusal that needs no change, before anything changes: launcher, parent, extra arguments, and the
    name (free in the lineage and, with `ask_target`, on the target: one read-only `status` call). Returns the
    chosen name. `restart` passes ask_target=False: its combined agent call refuses an existing run directory
    before it changes anything, so the extra round trip would buy nothing."""
    if request.launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {request.launcher!r}", hint="use --launcher tmux or --launcher nohup")
    if request.parent:
        validate_name(request.parent, what="parent run name")
        invocation.db.get(request.parent)  # NotFound (with close names) before anything happens
    merge_extra_args(
        list(profile.argv), request.extra_args, managed_flags(profile.argv, profile.resume_args), profile.name
    )
    name = choose_name(invocation, request)
    if invocation.record_of(name) is not None:
        raise Conflict(f"run name {name!r} is already used", hint="choose another --name, or --name + with --parent")
    # `--name +`: the name is provisional until claim_name picks the next free one in the lineage's own
    # transaction (a concurrent deploy may take this one first), so the target is asked after the claim.
    if ask_target and request.name != "+":
        check_free_on_target(invocation, target, name)
    return name


def check_free_on_target(invocation: Session, target: Target, name: str) -> None:
    """Conflict when `runs/<name>` exists on the target (a run the lineage does not know); read-only."""
    if invocation.dry_run:
        return
    existing = invocation.agent(target).ask("status", StatusRequest(workspace=target.workspace), StatusAnswer)
    if existing is not None and any(entry.name == name for entry in existing.runs):
        raise Conflict(
            f"run directory {target.workspace}/runs/{name} already exists on {target.name}",
            hint="`dflashops runs sync` records it; pick another --name",
        )


def claim_name(invocation: Session, request: DeployRequest, target: Target, profile: Profile, name: str) -> str:
    """Claim the new run's name (checked by `check_request`) in the lineage database before anything is
    synced or launched; `--name +` picks the next free name in the same transaction, so two shells deploying
    at once get two names. A dry run claims nothing. The caller releases the claim when the launch fails
    (`LineageDB.release`)."""
    if invocation.dry_run:
        return name
    claim = RunRecord(
        name=name,
        parent=request.parent,
        note=request.note,
        target=target.name,
        launcher=request.launcher,
        profile=profile.name,
    )
    return invocation.db.reserve(claim, after=request.parent if request.name == "+" else None)


def launch_on(
    invocation: Session, request: DeployRequest, target: Target, profile: Profile, name: str
) -> tuple[DeployOutcome, LaunchSpec]:
    """Sync the code to `target` and launch `name` there (one node of a run on several targets, or the whole
    run); the spec.s record has the pgid and session the agent answered. The lineage is the caller's."""
    agent = invocation.agent(target)
    run_dir = f"{target.workspace}/runs/{name}"
    if not invocation.dry_run:
        invocation.phase("sync", target=target.name)
    synced = sync(
        agent,
        extra_files=profile.files,
        extra_root=invocation.inventory.root,
        packages=profile.packages,
        cache=invocation.inventory.lineage_path,
    )
    spec = launch_spec(invocation, request, target, profile, name, synced.code_hash, synced.release_path)
    verdict = dry_run_preflight(agent, spec, synced.code_hash) if invocation.dry_run and request.preflight else None
    answer = agent.ask(
        "launch",
        spec.args,
        LaunchAnswer,
        secret_args={"env": spec.env},
        shown_args={"env": spec.record.env},
        on_progress=None if invocation.dry_run else lambda event: invocation.phase(**event),
    )
    if answer is not None:  # None: a dry run only planned it
        spec.record.extra["pgid"] = answer.pgid
        spec.record.session = answer.session or spec.record.session
    return DeployOutcome(
        name=name,
        target=target.name,
        run_dir=run_dir,
        code_hash=synced.code_hash,
        release=synced.release_path,
        pgid=answer.pgid if answer is not None else None,
        uploaded=len(synced.uploaded),
        cache_cleared=answer.cleared if answer is not None else None,
        standby=answer is not None and answer.standby,
        preflight=verdict if answer is None else answer.preflight,
    ), spec


def dry_run_preflight(agent: Agent, spec: LaunchSpec, code_hash: str, **more: Any) -> dict:
    """A dry run's pre-flight verdict: the agent's read-only `preflight` of the release when the target has it
    already (a refusal raises PreflightFailed, as the real launch would), else why it could not run yet."""
    answer = agent.ask(
        "preflight",
        PreflightRequest(
            **{each.name: getattr(spec.args, each.name) for each in fields(spec.args) if each.name != "run_json"},
            release=code_hash,
            **more,
        ),
        PreflightAnswer,
        secret_args={"env": spec.env},
        shown_args={"env": spec.record.env},
    )
    if answer is None:  # only planned: the agent is not on the target yet
        return {"skipped": None}
    return answer.preflight or {"skipped": answer.skipped}
