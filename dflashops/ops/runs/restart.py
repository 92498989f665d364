"""restart: the kill-copy-relaunch cycle as ONE agent call.

Stop the old run cleanly (SIGTERM first, so the trainer checkpoints), install the changed files,
optionally clear this code's compile cache, relaunch as a NEW run whose parent is the old one. `resume`
starts from the old run's latest checkpoint; nothing of the old run is deleted. A decoy process of the same
program outside the run is never touched (stop works by process group and run marker, never by name).

Cost on a remote target, where each agent call is a round trip through ssh + pct + python start-up
(~0.26 s at 50 ms RTT): the agent's `restart` verb does stop + install + launch in one call (agent/restart.py
verb_restart has the order that keeps a refusal or a cut from leaving anything half-done). The tar of
changed files is built against the release this controller last installed there (release_cache), so no
`manifest` call is needed first. When that base is gone from the target the agent refuses with
`stale_release`, having changed nothing, and this falls back to `manifest` + the combined call again.
No cache yet: `manifest` + the combined call (2 calls). Steady state: 1 call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from dflashops.agent import answers, protocol
from dflashops.core.errors import Conflict, NotFound, TransportError, UsageError
from dflashops.core.inventory import Profile, Target
from dflashops.core.shell import validate_name
from dflashops.lineage import RunRecord
from dflashops.ops.agent_client import Agent, Busy, StaleRelease, Superseded, Unchecked
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases import release_cache
from dflashops.ops.releases.sync import InstallPayload, install_payload, local_manifest, release_files
from dflashops.ops.runs.control import NotRunning
from dflashops.ops.runs.extra_args import over
from dflashops.ops.runs.launch import (
    DeployOutcome,
    DeployRequest,
    LaunchSpec,
    check_request,
    claim_name,
    dry_run_preflight,
    launch_spec,
)
from dflashops.ops.runs.nodes import relaunch_nodes
from dflashops.ops.runs.observer import observe_and_tell
from dflashops.ops.runs.supervise import after_launch

# Stands in argv/run.json for the old run's latest checkpoint, which only the agent knows after the stop.
RESUME_PLACEHOLDER = "@dflashops-latest-checkpoint@"


@dataclass
class RestartRequest:
    run: str
    name: str | None = "+"
    note: str = ""
    resume: bool = False
    clear_cache: bool = False
    launcher: str | None = None
    extra_args: list[str] | None = None  # merged over the parent's extra args, option by option
    reset_args: bool = False  # start from the profile's arguments: the parent's extra args are dropped
    checkpoint: str | None = None  # with resume: this STEP or PATH of the run or an ancestor, not the newest
    preflight: bool = True  # the new code and flags prove they can start before the old run is signalled
    # A live old run of a job the pre-flight cannot check (not the trainer, no profile `check:`) is stopped only
    # with this set (--unchecked); else the restart is refused with nothing stopped (ops/runs/restart.py unchecked).
    unchecked: bool = False
    grace: float = 60.0
    # With resume: launch as soon as the old trainer's devices are free and its final checkpoint is being
    # written (the agent's stop hand-over; the new trainer waits for the checkpoint). False: after its exit.
    handover: bool = True


@dataclass
class RestartOutcome:
    stopped: bool
    old_exit_code: int | None
    checkpoint: str | None
    deployed: DeployOutcome
    agent_calls: int = 0  # restart-path agent calls: 1 steady state, 2 without a cache, 3 after a stale one
    fell_back: bool = False  # the cached base was gone from the target; `manifest` was asked
    handover: bool = False  # the new run started while the old one was still writing its final checkpoint


def restart(invocation: Invocation, request: RestartRequest) -> RestartOutcome:
    """`dflashops restart RUN`: the old run's child, in six steps, one function each, called in this order:

    1. `resolve`: the old run's record and profile -> the child's DeployRequest (refusals from the lineage alone);
    2. `preflight`: the request's checks (ops/runs/launch.py check_request), the `--checkpoint` looked up, the
       child's name claimed in the lineage (released again if a later step fails);
    3. `sync`: the release the child runs from: the tar of changed files against the release this controller
       last installed there (release_cache; `manifest` asked only without one) and the child's launch spec;
    4-5. `stop_and_launch`: ONE agent call (`restart` verb) that pre-flights the new code (refusing to stop a
       live old run of a job it cannot check unless `unchecked`: see `unchecked`), stops the old run,
       installs the tar and launches the child (stop and launch are one step: split, they would be two round
       trips, and a cut between them would leave the old run stopped and no child);
    6. `record`: the old run's end and the child into the lineage, the release cache, the started notice and
       the child's supervisor (ops/runs/supervise.py after_launch).
    A run on several targets takes `restart_nodes` after step 1: every node stopped, then deployed again."""
    old, profile, child = resolve(invocation, request)
    if len(old.extra.get("nodes") or []) >= 2:
        return restart_nodes(invocation, request, old, profile, child)
    target, name, chosen = preflight(invocation, request, old, profile, child)
    try:
        release = sync(invocation, child, target, profile, name)
        answer, verdict, calls, fell_back = stop_and_launch(invocation, request, old, release, chosen)
        return record(
            invocation, request, child, old, release, answer, chosen, calls=calls, fell_back=fell_back, verdict=verdict
        )
    except BaseException:
        if not invocation.dry_run:
            invocation.db.release(name)
        raise


def resolve(invocation: Invocation, request: RestartRequest) -> tuple[RunRecord, Profile, DeployRequest]:
    """Step 1: (the old run's record, its profile, the child's DeployRequest); UsageError/NotFound/Conflict for
    what the lineage and the inventory refuse. Nothing is asked of the target."""
    validate_name(request.run, what="run name")
    old = invocation.db.get(request.run)  # NotFound with close names
    if old.profile is None or old.profile not in invocation.inventory.profiles:
        raise UsageError(
            f"run {old.name!r} was not started from a profile in this inventory",
            hint="deploy a new run with --profile and --parent instead",
        )
    profile = invocation.inventory.profile(old.profile)
    if request.resume and not profile.resume_args:
        raise UsageError(
            f"profile {profile.name!r} has no resume_args, so --resume cannot work",
            hint="use --fresh, or add resume_args to the profile",
        )
    if request.name not in (None, "+"):
        validate_name(request.name, what="run name")
        if invocation.record_of(request.name) is not None:
            raise Conflict(f"run name {request.name!r} is already used", hint="use --name + for the next free name")
    launcher = request.launcher or old.launcher
    extra = over([] if request.reset_args else list(old.extra.get("extra_args") or []), request.extra_args or [])
    if request.checkpoint is not None and not request.resume:
        raise UsageError("--checkpoint names the checkpoint to resume from", hint="add --resume")
    child = DeployRequest(
        target=old.target,
        profile=profile.name,
        name=request.name or "+",
        parent=old.name,
        note=request.note,
        launcher=launcher,
        clear_cache=request.clear_cache,
        extra_args=extra,
        checkpoint=RESUME_PLACEHOLDER if request.resume else None,
        preflight=request.preflight,
    )
    return old, profile, child


def restart_nodes(
    invocation: Invocation, request: RestartRequest, old: RunRecord, profile: Profile, child: DeployRequest
) -> RestartOutcome:
    """Steps 2-6 for a run on several targets (ops/runs/nodes.py relaunch_nodes): stop every node, deploy the child
    as a job on the same targets; no combined agent call."""
    stop, checkpoint, deployed = relaunch_nodes(
        invocation,
        old,
        profile,
        replace(child, target=None, checkpoint=None),  # relaunch_nodes resumes each node itself
        resume=request.resume,
        grace=request.grace,
        not_running=NotRunning,
    )
    return RestartOutcome(
        stopped=stop is not None,
        old_exit_code=stop.answer.exit_code if stop is not None and stop.answer is not None else None,
        checkpoint=checkpoint,
        deployed=deployed,
        agent_calls=0,
    )


def preflight(
    invocation: Invocation, request: RestartRequest, old: RunRecord, profile: Profile, child: DeployRequest
) -> tuple[Target, str, str | None]:
    """Step 2: (target, the claimed name, the chosen checkpoint or None). The request's checks need no round
    trip (ask_target=False: the combined call refuses an existing run directory before it changes anything);
    `--checkpoint` costs one `status` call per run of the chain. The new code's own pre-flight (compile,
    `python -m trainer check`) runs in the target, inside step 4-5's call, before the old run is signalled."""
    target = invocation.inventory.target(old.target)
    chosen = chosen_checkpoint(invocation, old, target, request.checkpoint) if request.checkpoint else None
    name = claim_name(
        invocation,
        child,
        target,
        profile,
        check_request(invocation, child, target, profile, ask_target=False),
    )
    return target, name, chosen


@dataclass
class Release:
    """What step 3 prepared: the files, their hash and manifest, the tar against the target's base, the spec."""

    target: Target
    profile: Profile
    files: dict[str, Path]
    code_hash: str
    manifest: dict[str, str]
    payload: InstallPayload
    spec: LaunchSpec
    calls: int  # agent calls it took: 0 with a cached base, 1 (`manifest`) without

    @property
    def path(self) -> str:
        return f"{self.target.workspace}/releases/{self.code_hash}"


def sync(invocation: Invocation, child: DeployRequest, target: Target, profile: Profile, name: str) -> Release:
    """Step 3: the child's release and launch spec; the tar holds only the files that differ from the release
    this controller last installed on `target` (release_cache), or from what `manifest` says is there."""
    files = release_files(profile.files, invocation.inventory.root, profile.packages)
    code_hash, manifest = local_manifest(files)
    spec = launch_spec(invocation, child, target, profile, name, code_hash, f"{target.workspace}/releases/{code_hash}")
    calls = 0
    base: tuple[str | None, dict[str, str]] | None = release_cache.load(invocation.inventory.lineage_path, target)
    if base is None:
        base, calls = remote_base(invocation.agent(target), code_hash, manifest), calls + 1
    payload = install_payload(target.workspace, files, code_hash, manifest, base[0], base[1])
    return Release(target, profile, files, code_hash, manifest, payload, spec, calls)


def stop_and_launch(
    invocation: Invocation, request: RestartRequest, old: RunRecord, release: Release, chosen: str | None
) -> tuple[answers.RestartAnswer | None, dict | None, int, bool]:
    """Steps 4-5: the combined call; returns (the agent's answer, None when a dry run only planned it; a dry
    run's read-only pre-flight verdict, else None; agent calls in all; fell back). When the cached base is gone
    from the target (StaleRelease: nothing was changed) the tar is built again against what `manifest` says and
    the call repeated."""
    agent = invocation.agent(release.target)
    calls, fell_back = release.calls, False
    if not invocation.dry_run:
        invocation.phase(
            "sync", files=len(release.payload.uploaded), target=release.target.name, code=release.code_hash
        )
    on_progress = None if invocation.dry_run else invocation.on_phase
    try:
        calls += 1
        answer = combined_call(agent, old.name, request, release.spec, release.payload, chosen, on_progress)
    except Unchecked:
        raise unchecked(invocation, old, release.profile) from None
    except StaleRelease:  # nothing was changed: ask what is there, build the tar again, call again
        base, fell_back = remote_base(agent, release.code_hash, release.manifest), True
        release.payload = install_payload(
            release.target.workspace, release.files, release.code_hash, release.manifest, base[0], base[1]
        )
        calls += 2
        try:
            answer = combined_call(agent, old.name, request, release.spec, release.payload, chosen, on_progress)
        except Unchecked:
            raise unchecked(invocation, old, release.profile) from None
    verdict = None
    if invocation.dry_run and request.preflight:
        try:
            verdict = dry_run_preflight(
                agent,
                release.spec,
                release.code_hash,
                old=old.name,
                resume_placeholder=RESUME_PLACEHOLDER if request.resume else None,
                resume_checkpoint=chosen,
                unchecked=request.unchecked,
            )
        except Unchecked:  # the dry run refuses as the restart would
            raise unchecked(invocation, old, release.profile) from None
    return answer, verdict, calls, fell_back


def record(
    invocation: Invocation,
    request: RestartRequest,
    child: DeployRequest,
    old: RunRecord,
    release: Release,
    answer: answers.RestartAnswer | None,
    chosen: str | None,
    *,
    calls: int,
    fell_back: bool,
    verdict: dict | None = None,
) -> RestartOutcome:
    """Step 6: the lineage (the old run's end, the child with its parent edge, its resumed checkpoint, pgid and
    session), the release cache, then the started notice and the child's supervisor; the outcome. `answer` is
    None when a dry run only planned the call; its `verdict` is the read-only pre-flight's."""
    target, spec, code_hash = release.target, release.spec, release.code_hash
    checkpoint = (chosen or f"<latest checkpoint of {old.name}>") if request.resume else None
    if answer is not None:
        checkpoint = answer.checkpoint
        if checkpoint:
            spec.record.argv = [arg.replace(RESUME_PLACEHOLDER, checkpoint) for arg in spec.record.argv]
            spec.record.extra["resumed_from"] = checkpoint
        spec.record.extra["pgid"] = answer.pgid
        spec.record.session = answer.session or spec.record.session
        # The old run's end (exit code, step) into its record: the observer takes status entries as JSON objects.
        observe_and_tell(invocation, [answers.answer_json(answer.old_status)])
        invocation.db.fill(spec.record)  # the new run, with its parent edge
        release_cache.save(invocation.inventory.lineage_path, target, code_hash, release.manifest)
    stop = answer.stop if answer is not None else None
    supervisor = after_launch(invocation, child, target, release.profile, spec.name, code_hash, release.path)
    deployed = DeployOutcome(
        name=spec.name,
        target=target.name,
        run_dir=spec.run_dir,
        code_hash=code_hash,
        release=release.path,
        pgid=answer.pgid if answer is not None else None,
        uploaded=len(release.payload.uploaded),
        cache_cleared=answer.cleared if answer is not None else None,
        supervisor=supervisor,
        standby=answer is not None and answer.standby,
        preflight=verdict if answer is None else answer.preflight,
    )
    return RestartOutcome(
        stopped=stop is not None,
        old_exit_code=stop.exit_code if stop is not None else None,
        checkpoint=checkpoint,
        deployed=deployed,
        agent_calls=calls,
        fell_back=fell_back,
        handover=stop is not None and bool(stop.handover),
    )


def unchecked(invocation: Invocation, old: RunRecord, profile: Profile) -> UsageError:
    """The refusal of a restart whose old run is alive and whose job the pre-flight cannot check (the agent's
    code `unchecked`): nothing was stopped or launched. A profile's `check:` makes it checkable; --unchecked
    stops the old run anyway. A run that already ended needs neither; a supervisor's revival never asks."""
    return UsageError(
        f"{old.name}'s job (profile {profile.name}) cannot be checked before the old run is stopped",
        hint=f"add check: to profile {profile.name} in {invocation.inventory.path} (a command that exits 0 when "
        "the job can start), or pass --unchecked to stop it anyway",
    )


def remote_base(agent: Agent, code_hash: str, manifest: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """(release, manifest) now current on the target (one `manifest` call); the agent skips the file list
    when the target already has `code_hash`, which then is its own base."""
    request = protocol.ManifestRequest(workspace=agent.target.workspace, hash=code_hash)
    remote = agent.ask("manifest", request, answers.ManifestAnswer)
    if remote is None:  # a dry run before the agent is on the target: nothing is there
        return None, {}
    if remote.release == code_hash:
        return code_hash, manifest
    return remote.release, remote.files


def combined_call(
    agent: Agent,
    old: str,
    request: RestartRequest,
    spec: LaunchSpec,
    payload: InstallPayload,
    chosen: str | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> answers.RestartAnswer | None:
    """The agent's `restart` verb: request JSON (secrets only in it, on stdin) + the tar, one round trip; its
    answer, None when a dry run only planned it. Its phases (pre-flight, stopping, stopped, launching) reach
    `on_progress` as they start."""
    target: Target = agent.target
    launch = {each.name: getattr(spec.args, each.name) for each in fields(spec.args)}  # the child's launch
    # A standby interpreter for this restart alone where the target keeps none (agent/restart.py
    # one_shot_standby): the pre-flight runs in it and the child is it, one import of torch on the way to the
    # first step instead of two. On the local target, whose inventory entry leaves `standby` off; a remote
    # target that wants the head start keeps a standby (`standby: true`), which the restart uses the same way.
    launch.update(clear_cache=request.clear_cache, standby_once=target.kind == "local")
    args = protocol.RestartRequest(
        **launch,
        old=old,
        grace=request.grace,
        install=payload.request,  # its workspace is the restart's
        tar_bytes=len(payload.tar),
        resume_placeholder=RESUME_PLACEHOLDER if request.resume else None,
        resume_checkpoint=chosen,
        handover=request.resume and request.handover,
        unchecked=request.unchecked,
    )
    try:
        return agent.ask(
            "restart",
            args,
            answers.RestartAnswer,
            secret_args={"env": spec.env},
            shown_args={"env": spec.record.env},
            stdin_tar=payload.tar,
            on_progress=on_progress,
        )
    except StaleRelease:
        raise
    except Superseded as exc:
        raise Conflict(exc.message, hint="`dflashops runs tree` shows the new run; restart that one to go on") from None
    except Busy as exc:
        raise Conflict(
            exc.message, hint=f"wait for it (`dflashops status {old}`), or end it at once: dflashops stop {old} --now"
        ) from None
    except NotFound as exc:
        hint = "use --fresh to start from scratch" if "no checkpoint" in exc.message else exc.hint
        raise NotFound(exc.message, hint=hint) from None
    except Conflict as exc:
        raise Conflict(exc.message, hint="`dflashops runs sync` records it; pick another --name") from None
    except TransportError as exc:
        raise TransportError(
            f"{target.name}: connection lost during the restart of {old} as {spec.name}: {exc.message}",
            hint=f"the agent completes or refuses the whole step on its own; `dflashops status --target "
            f"{target.name}` shows whether {spec.name} runs, `dflashops runs sync` records it",
        ) from None


def chosen_checkpoint(invocation: Invocation, old: RunRecord, target: Target, wanted: str) -> str:
    """`restart --checkpoint STEP|PATH`: the path of that checkpoint of `old` or of one of its ancestors on the
    same target (the newest run first: a step both hold comes from the nearer one); NotFound naming what there
    is. One `status` call per run of the chain."""
    chain: list[str] = []
    record: RunRecord | None = old
    while record is not None and len(chain) < 100:
        if record.target == old.target:
            chain.append(record.name)
        record = invocation.record_of(record.parent) if record.parent else None
    found: dict[str, list[str]] = {}
    agent = invocation.agent(target)
    for run in chain:
        try:
            answer = agent.ask(
                "status", protocol.StatusRequest(workspace=target.workspace, name=run), answers.StatusAnswer
            )
        except NotFound:
            continue
        if answer is None:  # a dry run before the agent is on the target: no run to look in
            continue
        entry = answer.runs[0]
        paths = [f"{entry.run_dir}/checkpoints/{name}" for name in entry.checkpoints]
        found[run] = paths
        for path in reversed(paths):
            step = path.rsplit("_", 1)[-1]
            if (wanted.isdigit() and int(step) == int(wanted)) or path == wanted.rstrip("/"):
                return path
    listed = ", ".join(f"{run}: {', '.join(p.rsplit('_', 1)[-1].lstrip('0') or '0' for p in paths) or 'none'}"
                       for run, paths in found.items())  # fmt: skip
    raise NotFound(
        f"no checkpoint {wanted} in {old.name} or its ancestors on {target.name} (steps: {listed or 'none'})",
        hint="give a step listed there, or a path under a run of that chain",
    )
