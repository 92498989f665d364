"""The doctor's verdicts: the probe's facts (agent/doctor_probe.py) -> one ok/warn/fail/skip line each, with a hint.

GPU checks depend on what the target declares: a target with `gpus:` must show the device nodes, a working
nvidia-smi whose driver matches the host's, and torch seeing exactly that many CUDA devices; a CPU target
(no `gpus:`) skips them. Thresholds are constants here, with their reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dflashops.core.inventory import Profile, Target

GIB = 1024**3
# A qwen3-8b checkpoint is 12.6 GB (bench/results/pipeline.md 2026-11-29); below 1 GiB even the tiny preset's logs and a
# checkpoint can fail. The cache holds Inductor/Triton kernels: a few hundred MB to a few GB per code hash.
WORKSPACE_FAIL, WORKSPACE_WARN = 1 * GIB, 20 * GIB
CACHE_FAIL, CACHE_WARN = 1 * GIB, 5 * GIB
# W&B and HTTPS refuse certificates and tokens with clocks minutes off; seconds already confuse log times.
CLOCK_WARN_S, CLOCK_FAIL_S = 2.0, 60.0
PASSTHROUGH_HINT = (
    "pass the devices into the container: lxc.cgroup2.devices.allow: c 195:* rwm (and the "
    "nvidia-uvm major) plus lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file "
    "for each GPU, nvidiactl and nvidia-uvm, in /etc/pve/lxc/CTID.conf"
)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 1024**2:.0f} MiB"


def gpu_checks(target: Target, answer: dict[str, Any], host_driver: str | None) -> list[Check]:
    want = len(target.gpus)
    if not want:
        return [Check(name, "skip", "CPU target: no gpus declared") for name in ("gpu devices", "nvidia-smi", "driver")]
    checks = []
    nodes = answer.get("devices") or []
    numbered = [n for n in nodes if n.removeprefix("/dev/nvidia").isdigit()]
    missing = [n for n in ("/dev/nvidiactl", "/dev/nvidia-uvm") if n not in nodes]
    if not numbered or missing:
        what = "no /dev/nvidia* device nodes" if not nodes else f"missing {', '.join(missing or ['/dev/nvidiaN'])}"
        checks.append(Check("gpu devices", "fail", f"{what} (target declares {want} GPU(s))", PASSTHROUGH_HINT))
    elif len(numbered) < want:
        checks.append(
            Check(
                "gpu devices",
                "fail",
                f"{len(numbered)} /dev/nvidiaN node(s) for {want} declared GPUs",
                PASSTHROUGH_HINT,
            )
        )
    else:
        checks.append(Check("gpu devices", "ok", f"{', '.join(nodes)}"))
    smi = answer.get("nvidia_smi") or {}
    driver = None
    if not smi.get("path"):
        checks.append(
            Check(
                "nvidia-smi",
                "fail",
                "nvidia-smi not found in the target",
                "install the host's driver version without its kernel module in the container "
                "(NVIDIA-Linux-*.run --no-kernel-module)",
            )
        )
    elif smi.get("exit_code") != 0:
        said = " / ".join(smi.get("output") or []) or smi.get("error") or "no output"
        mismatch = "mismatch" in said.lower()
        checks.append(
            Check(
                "nvidia-smi",
                "fail",
                f"nvidia-smi failed (exit {smi.get('exit_code')}): {said}",
                "the container's NVIDIA libraries must be the host driver's exact version; reinstall "
                "them with --no-kernel-module"
                if mismatch
                else PASSTHROUGH_HINT,
            )
        )
    else:
        drivers = sorted({g["driver"] for g in smi.get("gpus") or []})
        driver = drivers[0] if len(drivers) == 1 else None
        checks.append(Check("nvidia-smi", "ok", f"{len(smi.get('gpus') or [])} GPU(s), driver {', '.join(drivers)}"))
    reference = host_driver or answer.get("kernel_module")
    source = "host nvidia-smi" if host_driver else "kernel module"
    if driver is None:
        checks.append(Check("driver", "skip", "no working nvidia-smi to compare"))
    elif reference is None:
        checks.append(
            Check(
                "driver",
                "warn",
                f"container driver {driver}; the host's version could not be read",
                "run nvidia-smi on the host and compare by hand",
            )
        )
    elif reference != driver:
        checks.append(
            Check(
                "driver",
                "fail",
                f"container driver {driver} != {source} {reference}",
                "install exactly the host's driver version (userspace only) in the container",
            )
        )
    else:
        checks.append(Check("driver", "ok", f"{driver} matches the {source}"))
    return checks


PYTHON_DEPENDENT = ("torch", "cuda", "transformers", "triton")  # judged on what the run's python imports


def python_skips(python: str) -> list[Check]:
    """The checks a run's python that cannot run leaves nothing to judge on: skipped, as docs/targets.md says of
    every check after a failed one (else `/bin/true` as the python would fail torch too)."""
    return [Check(name, "skip", f"the python check failed ({python} cannot run)") for name in PYTHON_DEPENDENT]


def import_checks(target: Target, imports: dict[str, Any]) -> list[Check]:
    want = len(target.gpus)
    if imports.get("missing"):  # gone between the python check and the import probe
        return python_skips(target.python)
    if imports.get("error"):
        return [
            Check(
                "torch",
                "fail",
                f"the import probe failed: {imports['error']}",
                "run the python in the target by hand: python -c 'import torch'",
            )
        ]
    checks = []
    if imports.get("torch_error"):
        checks.append(
            Check(
                "torch",
                "fail",
                f"{imports.get('executable')} cannot import torch: {imports['torch_error']}",
                f"install torch into that python (or point `python:` of {target.name} at a venv with it)",
            )
        )
    else:
        build = f"CUDA {imports['cuda_build']} build" if imports.get("cuda_build") else "CPU build"
        checks.append(Check("torch", "ok", f"torch {imports.get('torch')} ({build})"))
        seen = int(imports.get("device_count") or 0)
        if not want:
            checks.append(Check("cuda", "skip", "CPU target: no gpus declared"))
        elif not imports.get("cuda_available"):
            checks.append(
                Check(
                    "cuda",
                    "fail",
                    f"torch.cuda.is_available() is False ({want} GPU(s) declared)",
                    "a CPU build of torch, or no device nodes: see the gpu checks above",
                )
            )
        elif seen != want:
            checks.append(
                Check(
                    "cuda",
                    "fail",
                    f"torch sees {seen} CUDA device(s), the target declares {want}",
                    "check CUDA_VISIBLE_DEVICES and the devices passed into the container",
                )
            )
        else:
            checks.append(Check("cuda", "ok", f"{seen} device(s): {', '.join(imports.get('devices') or [])}"))
    for name, needed in (("transformers", True), ("triton", bool(want))):
        if imports.get(name):
            checks.append(Check(name, "ok", f"{name} {imports[name]}"))
        elif needed:
            checks.append(
                Check(
                    name,
                    "fail",
                    f"cannot import {name}: {imports.get(name + '_error')}",
                    f"pip install {name} into the run's python",
                )
            )
        else:
            checks.append(Check(name, "skip", "not installed; not needed on a CPU target"))
    return checks


def disk_check(name: str, facts: dict[str, Any], fail_at: int, warn_at: int, same_as: int | None = None) -> Check:
    if facts.get("error"):
        return Check(name, "fail", f"cannot measure {facts.get('path')}: {facts['error']}")
    free, where = int(facts["free_bytes"]), facts["measured_at"]
    detail = f"{size(free)} free of {size(int(facts['total_bytes']))} at {where}"
    if same_as is not None and facts.get("device") == same_as:
        return Check(name, "skip", f"{facts.get('path')} is on the workspace's filesystem (checked above)")
    hint = f"free space on the filesystem of {where} (old checkpoints: `dflashops gc --run NAME`)"
    if free < fail_at:
        return Check(name, "fail", detail, hint)
    return Check(name, "warn", detail, hint) if free < warn_at else Check(name, "ok", detail)


def judge_probe(
    target: Target, answer: dict[str, Any], arrived: float, *, host_driver: str | None, python_check: Check | None
) -> list[Check]:
    imports = answer.get("imports") or {}
    checks = [
        python_check
        or Check(
            "python",
            "ok",
            f"Python {imports.get('version', answer.get('probe_version'))}"
            f" ({imports.get('executable') or target.python})",
        )
    ]
    checks += gpu_checks(target, answer, host_driver)
    python_failed = python_check is not None and python_check.status == "fail"
    checks += python_skips(target.python) if python_failed else import_checks(target, imports)
    tools = answer.get("tools") or {}
    checks.append(
        Check("tmux", "ok", tools["tmux"])
        if tools.get("tmux")
        else Check(
            "tmux",
            "fail",
            "tmux not found: deploy's default launcher (and `attach`) need it",
            "apt-get install tmux in the target, or deploy with --launcher nohup",
        )
    )
    checks.append(Check("nohup", "ok", "built into the agent (setsid, stdin from /dev/null): no binary needed"))
    disks = answer.get("disk") or {}
    workspace = disks.get("workspace") or {}
    checks.append(disk_check("disk workspace", workspace, WORKSPACE_FAIL, WORKSPACE_WARN))
    checks.append(disk_check("disk cache", disks.get("cache") or {}, CACHE_FAIL, CACHE_WARN, workspace.get("device")))
    write = answer.get("writable") or {}
    if write.get("ok"):
        checks.append(
            Check(
                "workspace",
                "ok",
                f"{target.workspace} is writable"
                if write.get("exists")
                else f"{target.workspace} does not exist yet; {write.get('at')} takes new files",
            )
        )
    else:
        checks.append(
            Check(
                "workspace",
                "fail",
                f"cannot create a file: {write.get('error')}",
                f"make {target.workspace} writable for the user the agent runs as",
            )
        )
    checks.append(standby_check(target, answer.get("standbys") or []))
    checks.append(compile_cache_check(answer.get("compile_cache") or {}))
    offset = float(answer.get("time", arrived)) - arrived  # + the answer's one-way trip: milliseconds
    detail = f"target clock {offset:+.2f} s from this machine's"
    status = "fail" if abs(offset) >= CLOCK_FAIL_S else "warn" if abs(offset) >= CLOCK_WARN_S else "ok"
    checks.append(Check("clock", status, detail, None if status == "ok" else "enable NTP (chrony/systemd-timesyncd)"))
    return checks


def standby_check(target: Target, found: list[dict[str, Any]]) -> Check:
    """The standby interpreters (dflashops/agent/standby.py): what waits, and whether that is what the inventory asks."""
    waiting = [s for s in found if s.get("pid") and s.get("alive") and not s.get("claimed") and not s.get("retired")]
    described = ", ".join(f"pid {s['pid']} ready for {float(s.get('waiting_s') or 0) / 60:.0f} min" for s in waiting)
    if not target.standby:
        if waiting:
            return Check(
                "standby",
                "warn",
                f"{len(waiting)} standby interpreter(s) waiting ({described}) although the target's standby is off",
                f"dflashops gc {target.name} --standby (they also exit after standby_idle_s)",
            )
        return Check("standby", "skip", "off (inventory `standby: true` keeps the next run's python ready)")
    if waiting:
        return Check(
            "standby",
            "ok",
            f"{described}; the next trainer launch takes it (unused, it exits after {target.standby_idle_s} s)",
        )
    return Check("standby", "ok", "none waiting yet: a trainer launch starts one, ready after that run's first step")


# The flags by which a profile's argv names GPU indices (the trainer's): the highest index + 1 is how many GPUs
# the target must declare for the profile to run there.
GPU_FLAGS = ("--target-gpus", "--drafter-gpus", "--gpus")


def gpus_needed(profile: Profile) -> int:
    """How many GPUs `profile` needs on a target: from its argv's GPU indices (`--target-gpus 0,1 --drafter-gpus
    2,3`: 4), 1 for a `{gpus}` placeholder, else 0 (a CPU profile)."""
    needed = 0
    argv = list(profile.argv)
    for index, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in GPU_FLAGS and not value and index + 1 < len(argv):
            value = argv[index + 1]
        if flag in GPU_FLAGS:
            for part in value.split(","):
                part = part.strip().removeprefix("cuda:")
                if part.isdigit():
                    needed = max(needed, int(part) + 1)
        if "{gpus}" in arg:
            needed = max(needed, 1)
    return needed


def secret_checks(
    profiles: list[Profile], environ: dict[str, str], explicit: bool, target: Target | None = None
) -> list[Check]:
    """pass_env names a profile sends to its runs: set in this shell? Names only, never values. Missing is a
    warning (the run starts without it), a failure for a named profile whose argv logs to W&B without its key.
    Without a named profile, a secret only profiles the target cannot run need (more GPUs than it declares: the
    shipped qwen3-8b's HF_TOKEN on the CPU `local` target) is a skip line, not a warning."""
    runnable = [p for p in profiles if explicit or target is None or gpus_needed(p) <= len(target.gpus)]
    needed: dict[str, list[str]] = {}
    for profile in runnable:
        for name in profile.pass_env:
            needed.setdefault(name, []).append(profile.name)
    checks = []
    for name in sorted({name for p in profiles for name in p.pass_env} - set(needed)):
        assert target is not None  # every profile is runnable without a target
        passing = [p for p in profiles if name in p.pass_env]
        checks.append(
            Check(
                f"secret {name}",
                "skip",
                f"only {', '.join(p.name for p in passing)} pass(es) it, which need(s) "
                f"{min(gpus_needed(p) for p in passing)} GPU(s); {target.name} declares {len(target.gpus)}",
            )
        )
    for name, users in sorted(needed.items()):
        if name in environ:
            checks.append(Check(f"secret {name}", "ok", f"set in this shell (passed by {', '.join(users)})"))
            continue
        wandb = (
            name == "WANDB_API_KEY"
            and explicit
            and any(any(arg.startswith("--wandb-project") for arg in p.argv) for p in profiles)
        )
        checks.append(
            Check(
                f"secret {name}",
                "fail" if wandb else "warn",
                f"not set in this shell; {', '.join(users)} pass(es) it, so runs start without it",
                f"export {name}=... before deploying (it travels only in the run's environment)",
            )
        )
    return checks


def compile_cache_check(found: dict[str, Any]) -> Check:
    """Whether the target's compile cache is warm for the code this controller would deploy now (a run of it
    has compiled or reused its graphs there), and what the cache holds. Never a failure: cold costs time only."""
    caches = found.get("caches") or []
    held = ", ".join(f"{c['key']}: {c['files']} files, {c['bytes'] / 2**20:.0f} MiB" for c in caches) or "empty"
    newest = found.get("newest_run")
    code = str(found.get("code_hash") or "")[:16]
    if newest:
        used = str(newest.get("dir") or "").rstrip("/").rsplit("/", 1)[-1]  # the target's path: posix
        files = sum(int(c.get("files") or 0) for c in caches if c.get("key") == used)
        hits, misses = int(newest.get("fxgraph_hit") or 0), int(newest.get("fxgraph_miss") or 0)
        if files and (hits or misses):
            return Check(
                "compile cache",
                "ok",
                f"warm for the current code {code}: its run {newest['run']} compiled {misses} graph(s) and reused "
                f"{hits} ({held})",
            )
        # Warm means compiled graphs are there to reuse: not a cache emptied since (--clear-cache, by hand),
        # nor a run that compiled nothing (a CPU run without torch.compile, or one stopped before its first step).
        why = (
            f"its run {newest['run']} compiled {misses} graph(s) and reused {hits}, but {used or 'its cache'} "
            "holds none now: the next run compiles them again"
            if hits or misses
            else f"its run {newest['run']} compiled no graph here (nothing to reuse)"
        )
        return Check("compile cache", "ok", f"not warm for the current code {code}: {why} ({held})")
    return Check(
        "compile cache",
        "ok",
        f"no run of the current code {code} here yet: its first run compiles what changed, reuses the rest ({held})",
    )
