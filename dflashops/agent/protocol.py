"""The agent's wire protocol: one dataclass per verb's request, parsed and checked once at the entry.

A request is one JSON object (`--json-args`, `--json-stdin`, or the first line of `install`/`restart`'s stdin).
`parse(verb, obj)` turns it into that verb's dataclass, or refuses it with ONE `bad_request` naming the verb
and the key: an unknown key, a missing required key, or a value of the wrong JSON type. A key absent from the
JSON takes its field's default, so an optional key behaves as before. The verbs then read attributes, and the
controller builds its requests from the same classes (`wire(request)`), so the two sides spell no key twice.
The answers are answers.py's, the same way round.

What is checked here is the shape; what a value means (an absolute workspace, a safe name, a known launcher,
an argv of strings) is checked by the verb that uses it, with the message it always gave.

Standard library only, and cheap to import: every agent call imports this module (zipimport compiles it each
time), so it holds the definitions and one small checker, nothing else. What the classes cost is paid by
every call, so they are not `frozen` (on python 3.11 that made their creation ~10x dearer: ~73 ms against ~7 ms
of CPU on the loaded 2-core dev machine) and get no generated `__eq__` or `__repr__` (~8 ms -> ~3.7 ms); a
request is read-only all the same (a changed one is a new one: dataclasses.replace), and `wire` shows one.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .common import AgentFailure

KILL_TIMEOUT_S = 10.0
GPU_TIMEOUT_S = 60.0
PROTOCOL_VERSION = 1  # `ping` answers it; the controller refuses an agent that answers another (ops/agent_client.py)

# The JSON types a field's annotation allows (its first word: `list[str] | None` -> list, None). int is
# accepted where a float is asked: JSON has one number type, and `5` is a fine grace.
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "list": (list,),
    "dict": (dict,),
    "None": (type(None),),
    "Any": (object,),
}


@dataclass(kw_only=True, eq=False, repr=False)
class Request:
    """What every verb's request is (the controller's Agent.call takes one); its fields are its JSON keys."""


@dataclass(kw_only=True, eq=False, repr=False)
class PingRequest(Request):
    """`ping`: no keys."""


@dataclass(kw_only=True, eq=False, repr=False)
class GpusRequest(Request):
    """`gpus`: no keys (nvidia-smi's list)."""


@dataclass(kw_only=True, eq=False, repr=False)
class WorkspaceRequest(Request):
    """A request about one workspace (an absolute path, checked by the verb: common.workspace_of)."""

    workspace: str


@dataclass(kw_only=True, eq=False, repr=False)
class RunRequest(WorkspaceRequest):
    """A request about one run of a workspace (a safe name, checked by the verb: common.run_dir)."""

    name: str


@dataclass(kw_only=True, eq=False, repr=False)
class StatusRequest(WorkspaceRequest):
    """`status`: one run (`name`) or all runs; `ended_within_s` leaves out runs that ended longer ago."""

    name: str | None = None
    ended_within_s: float | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class StopTimes(Request):
    """How long a stop (or a restart's stop) waits at each stage; also how long a command waits for another one
    on the same run (run_lock.control_wait_s)."""

    grace: float = 60.0
    save_grace: float = 600.0
    kill_timeout: float | None = None  # None: KILL_TIMEOUT_S
    gpu_timeout: float | None = None  # None: GPU_TIMEOUT_S

    def kill_s(self) -> float:
        """How long the stop waits for the processes to go after SIGKILL."""
        return KILL_TIMEOUT_S if self.kill_timeout is None else float(self.kill_timeout)

    def gpu_s(self) -> float:
        """How long the stop waits for the run's GPU memory to be freed."""
        return GPU_TIMEOUT_S if self.gpu_timeout is None else float(self.gpu_timeout)


@dataclass(kw_only=True, eq=False, repr=False)
class StopRequest(StopTimes, RunRequest):
    """`stop`: TERM, grace, KILL; `now` kills at once; `by` names who stops ("restart" for a restart of a run on
    several targets); `handover` lets the stop answer at the trainer's hand-over offer (restart --resume)."""

    now: bool = False
    by: str | None = None  # None: "stop"
    handover: bool = False


@dataclass(kw_only=True, eq=False, repr=False)
class TailRequest(RunRequest):
    """`tail` and `follow`: a cursor into train.log (offset, inode, check), where a first read starts (`lines`,
    `align`), how much one answer carries and how long `tail` may wait for something new."""

    offset: int | None = 0
    inode: int | None = None
    check: str | None = None
    lines: int | None = None
    align: bool = False
    max_bytes: int | None = None  # None: 1 MiB
    wait_s: float | None = None  # None: answer at once


@dataclass(kw_only=True, eq=False, repr=False)
class ClearCacheRequest(WorkspaceRequest):
    """`clear-cache`: the compile cache root (default <workspace>/cache/compile)."""

    compile_cache: str | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class ManifestRequest(WorkspaceRequest):
    """`manifest`: the current release's (no file list when it is `hash` already), or release `release`'s."""

    hash: str | None = None
    release: str | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class InstallRequest(WorkspaceRequest):
    """`install` (and the `install` of a `restart`): release `hash`, as the full `files` manifest and the `link`
    list, or compactly as `changed` and `removed` against `base`; `tar_bytes`: the size of the tar that follows;
    `keep`: how many releases pruning keeps."""

    hash: str | None = None
    base: str | None = None
    changed: dict | None = None
    removed: list | None = None
    files: dict | None = None
    link: list | None = None
    keep: int = 5
    tar_bytes: int | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class GcRequest(WorkspaceRequest):
    """`gc`: releases beyond `keep`, the named `runs` that are not running, with `standby` the waiting
    standbys; `dry_run` says what would go."""

    keep: int = 5
    runs: list = field(default_factory=list)
    standby: bool = False
    dry_run: bool = False


@dataclass(kw_only=True, eq=False, repr=False)
class WrapRequest(Request):
    """`wrap` (internal): the launch wrapper of run directory `dir`, or of the standby in folder `standby`."""

    dir: str | None = None
    standby: str | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class StandbyRequest(Request):
    """`standby` (internal): the standby interpreter of folder `dir`."""

    dir: str


@dataclass(kw_only=True, eq=False, repr=False)
class FetchManifestRequest(RunRequest):
    """`fetch-manifest`: sizes (and with `hash`, sha256) of the run's files under `paths`; `cache` keeps the
    hashes for the next call (off for a dry run)."""

    paths: list = field(default_factory=list)
    hash: bool = True
    cache: bool = True


@dataclass(kw_only=True, eq=False, repr=False)
class ReadFileRequest(RunRequest):
    """`read-file`: raw bytes of the run's file `path` from `offset`, `length` bytes (-1: to its end)."""

    path: str | None = None
    offset: int = 0
    length: int = -1


@dataclass(kw_only=True, eq=False, repr=False)
class LaunchRequest(RunRequest):
    """`launch`: run `name` is `argv` in `cwd` (default: its run directory) with `env` on top of the agent's
    environment, started by `launcher`; `run_json` is written as run.json. `standby`: adopt a ready standby
    (and start the next one); False retires the waiting ones. `secret_keys`: the names of `env`'s secrets.
    `preflight`: check the release first (`check`: a profile's own check). `clear_cache`: clear the compile
    cache (`compile_cache`) after the pre-flight. `progress`: say each phase on stderr."""

    argv: list
    env: dict = field(default_factory=dict)
    launcher: str = "nohup"
    cwd: str | None = None
    run_json: dict = field(default_factory=dict)
    standby: bool | None = None
    standby_once: bool = False  # adopt the standby started for this launch alone; start none after it
    standby_idle_s: float | None = None
    standby_preload: list | None = None
    secret_keys: list = field(default_factory=list)
    preflight: bool = False
    check: dict | None = None
    clear_cache: bool = False
    compile_cache: str | None = None
    progress: bool = False
    resuming: str | None = None  # the checkpoint a restart resumes, for the `launching` progress line


@dataclass(kw_only=True, eq=False, repr=False)
class ResumeRequest(LaunchRequest):
    """What a restart adds to a launch, and a dry run's `preflight` of one: the `old` run, the
    `resume_placeholder` standing in argv for its checkpoint (or `resume_checkpoint`, the one chosen), and
    `unchecked` (stop an old run whose new job the pre-flight could only compile)."""

    old: str | None = None
    resume_placeholder: str | None = None
    resume_checkpoint: str | None = None
    unchecked: bool = False


@dataclass(kw_only=True, eq=False, repr=False)
class PreflightRequest(ResumeRequest):
    """`preflight`: the pre-flight alone of release `release` (a code hash already on the target)."""

    release: str | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class RestartRequest(StopTimes, ResumeRequest):
    """`restart`: stop `old` (with the stop's times; `handover` as `stop`'s), install `install` (its tar of
    `tar_bytes` follows this line), launch this request's run from it."""

    install: InstallRequest | None = None
    tar_bytes: int | None = None
    handover: bool = False


REQUESTS: dict[str, type[Request]] = {
    "ping": PingRequest,
    "gpus": GpusRequest,
    "status": StatusRequest,
    "stop": StopRequest,
    "tail": TailRequest,
    "follow": TailRequest,
    "clear-cache": ClearCacheRequest,
    "manifest": ManifestRequest,
    "install": InstallRequest,
    "gc": GcRequest,
    "wrap": WrapRequest,
    "standby": StandbyRequest,
    "fetch-manifest": FetchManifestRequest,
    "read-file": ReadFileRequest,
    "launch": LaunchRequest,
    "preflight": PreflightRequest,
    "restart": RestartRequest,
}
# Fields that hold another request, parsed as that verb's (its keys named `restart: install.KEY`).
NESTED: dict[str, str] = {"install": "install"}


def parse(verb: str, obj: dict[str, Any], *, partial: bool = False) -> Any:
    """`obj` (one JSON object) as `verb`'s request dataclass, or AgentFailure `bad_request` naming the verb and
    the first unknown, missing or mistyped key (a nested request's keys as `install.KEY`). `partial`: check the
    keys that are there and return None (the controller's early check of a request it did not build)."""
    return parse_as(REQUESTS[verb], obj, verb, "", partial)


def parse_as(cls: type[Request], obj: dict[str, Any], verb: str, prefix: str, partial: bool = False) -> Any:
    """`obj` as an instance of request class `cls`; refusals name `verb` and the key (after `prefix`)."""
    known = {each.name: each for each in fields(cls)}
    for key in obj:
        if key not in known:
            raise AgentFailure(
                f"{verb}: unknown key '{prefix}{key}' (keys: {', '.join(sorted(known)) or 'none'})", "bad_request"
            )
    values = {}
    for name, each in known.items():
        if name not in obj:
            if each.default is MISSING and each.default_factory is MISSING and not partial:
                raise AgentFailure(f"{verb}: missing key '{prefix}{name}'", "bad_request")
            continue
        value = obj[name]
        words = str(each.type).split("|")
        if not isinstance(value, tuple(kind for word in words for kind in json_types(word))):
            want = " or ".join(word.strip() for word in words)
            raise AgentFailure(
                f"{verb}: key '{prefix}{name}' must be {want}, not {type(value).__name__}", "bad_request"
            )
        if name in NESTED and isinstance(value, dict):
            nested = {"workspace": obj.get("workspace", ""), **value}
            value = parse_as(REQUESTS[NESTED[name]], nested, verb, name + ".", partial)
        values[name] = value
    return None if partial else cls(**values)


def json_types(word: str) -> tuple[type, ...]:
    """The Python types of one word of an annotation (`list[str]` -> list; a request class -> dict)."""
    base = word.strip().split("[", 1)[0]
    return JSON_TYPES.get(base, (dict,))


def wire(request: Request) -> dict[str, Any]:
    """The JSON object of a request dataclass, what `parse` reads back: every field, except one left at an
    empty default (None, False, "", [] or {}), which the agent fills in the same; a default number or word is
    sent, so a dry run's plan shows the grace it will use. Nested requests become objects. A shallow walk
    rather than dataclasses.asdict, which deep-copies every list and dict it meets."""
    out = {}
    for each in fields(request):
        value = getattr(request, each.name)
        default = each.default_factory() if each.default_factory is not MISSING else each.default
        if value == default and not default:  # MISSING (a required field) is truthy: always sent
            continue
        out[each.name] = wire(value) if isinstance(value, Request) else value
    return out
