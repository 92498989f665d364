"""The agent's answers: one dataclass per verb's answer, built by the agent and parsed by the controller.

A verb returns its answer's dataclass; the agent's entry prints `{"ok": true, **answer_json(answer)}`, the same
JSON line the verb's dict gave before (same keys and values, and the same order except a `stop --now`'s, whose
dicts put `now` elsewhere: StopAnswer), so the wire and PROTOCOL_VERSION are unchanged. Every verb answers so
but `ping` (a dict on the agent, checked as a PingAnswer on the controller: __main__.py verb_ping) and the
internal `wrap` and `standby`, whose `{"exit_code": N}` never reaches the wire (it becomes their process's exit
status) and would gain nothing from a class.
The controller (ops/agent_client.py `Agent.ask`) reads that line back with `parse_answer(verb, cls, obj)`:
an unknown key, a missing required key or a value of the wrong JSON type is ONE AnswerMismatch naming the verb
and the key (`runs[0].state`), and the controller then reads attributes, not string keys.

A field whose metadata is OPTIONAL is a key the answer carries only sometimes: left out of the JSON when it is
None, None when the JSON lacks it (a status run entry's `restarted_as`, a manifest's `path`); one that an answer
carries as null is named in its `nulls` (a stop's `launcher_exit_code`, null after its bookkeeping, absent in
its other shapes). Nested entries (a status run, a GPU, a fetched file, a removed folder, a restart's stop and
old run, a launch's cache clearing) are dataclasses of their own, named in ENTRIES so a field's annotation
(`list[RunEntry]`, `StopAnswer | None`) says how to parse them.

Standard library only, and cheap to import: the verbs that answer with one of these import this module on
every call, and zipimport compiles it each time; like protocol.py's requests, the classes are not `frozen`
and get no generated `__eq__` or `__repr__` (their creation is what every call pays). Measured on the loaded
2-core dev machine (2026-12-07, load ~3.4, the zipapp run by /usr/bin/python3 3.11, 50 calls each): the
import costs ~3.4-4.6 ms a call (`python -X importtime`); a `status` of 20 runs went from 61-71 to 64-74 ms of
CPU a call, `ping` (which does not import this module) stayed at 49-52 ms. Building and printing the answer
of 1,000 runs costs ~5 ms on the agent; parsing it on the controller ~6 ms (shape_of). StopAnswer,
LaunchAnswer and RestartAnswer (and `nulls`, `__contains__`) made the module dearer for every verb but `ping`:
compiling and running it went from 2.3 to 3.1 ms of CPU (the fastest of 60, /usr/bin/python3 3.11, same
machine, load ~1.2; +0.3 ms compile, +0.55 ms the classes' creation). Parsing a restart's answer (its stop and
old run inside) costs ~10 us, printing it ~20 us.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .protocol import JSON_TYPES

OPTIONAL = {"optional": True}  # a field's metadata: its key is left out of the JSON when the value is None


class AnswerMismatch(ValueError):
    """An answer that is not its verb's dataclass: an unknown, missing or mistyped key (the message names the
    verb and the key). Raised on the controller's side, where the agent and the controller disagree."""


@dataclass(kw_only=True, eq=False, repr=False)
class Answer:
    """What every answer and nested entry is; its fields are its JSON keys, in the JSON's order."""

    # The OPTIONAL keys this answer carries as null instead of leaving them out, where a verb's shapes differ in
    # that alone (a stop's bookkeeping carries `launcher_exit_code` as null, its other shapes lack the key).
    # Unannotated, so no field and no JSON key; an answer that sets none pays one empty-set lookup per None.
    nulls = frozenset[str]()

    def __getitem__(self, key: str) -> Any:
        """A field read by its JSON key (`status["state"]`), as a verb's dict answer was read: what the tests of
        the verbs' functions do. The package and the controller read attributes, which mypy checks."""
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        """Whether the answer's JSON carries `key` (`"handover" in stop`), as a dict answer was asked: an OPTIONAL
        field only when it is set (or in `nulls`)."""
        for each in fields(self):
            if each.name == key:
                return not each.metadata.get("optional") or getattr(self, key) is not None or key in self.nulls
        return False


@dataclass(kw_only=True, eq=False, repr=False)
class PingAnswer(Answer):
    """`ping`: the protocol version this agent speaks and its python's version."""

    version: int
    python: str


@dataclass(kw_only=True, eq=False, repr=False)
class GpuEntry(Answer):
    """One GPU of `gpus` (nvidia-smi's fields)."""

    index: int
    name: str
    memory_used_mib: int
    memory_total_mib: int
    utilization_pct: int


@dataclass(kw_only=True, eq=False, repr=False)
class GpusAnswer(Answer):
    """`gpus`: whether nvidia-smi is there, and its GPUs."""

    available: bool
    gpus: list[GpuEntry]


@dataclass(kw_only=True, eq=False, repr=False)
class ManifestAnswer(Answer):
    """`manifest`: the release's code hash (None: no such release, or no current one), its folder (`path`: the
    current release's only), and its manifest, path -> sha256 (empty when the target has `hash` already)."""

    release: str | None
    path: str | None = field(default=None, metadata=OPTIONAL)
    files: dict[str, str]


@dataclass(kw_only=True, eq=False, repr=False)
class InstallAnswer(Answer):
    """`install`: the release now current, its folder, and the old releases pruned."""

    release: str
    path: str
    removed: list[str]


@dataclass(kw_only=True, eq=False, repr=False)
class ClearCacheAnswer(Answer):
    """`clear-cache` (and a launch's or restart's `cleared`): the folders removed, their bytes and files."""

    removed: list[str]
    bytes: int
    files: int


@dataclass(kw_only=True, eq=False, repr=False)
class RemovedEntry(Answer):
    """One folder `gc` deleted (or would): a run directory, with its last `final` state, exit code and step
    (for the lineage record that outlives it), or a release."""

    kind: str
    name: str
    path: str
    bytes: int
    files: int
    final: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True, eq=False, repr=False)
class GcAnswer(Answer):
    """`gc`: the names of the releases and runs removed, the standbys retired, each removed folder, and whether
    it was a dry run (nothing removed)."""

    removed_releases: list[str]
    removed_runs: list[str]
    retired_standbys: list[str]
    removed: list[RemovedEntry]
    dry_run: bool


@dataclass(kw_only=True, eq=False, repr=False)
class FetchFile(Answer):
    """One file of `fetch-manifest`: run-relative path, size, sha256 (None: not cached, not asked to hash)."""

    path: str
    size: int
    sha256: str | None


@dataclass(kw_only=True, eq=False, repr=False)
class FetchManifestAnswer(Answer):
    """`fetch-manifest`: the files under the asked paths, the paths that do not exist, the run's directory."""

    files: list[FetchFile]
    missing: list[str]
    run_dir: str


@dataclass(kw_only=True, eq=False, repr=False)
class TailAnswer(Answer):
    """`tail` (and each line of `follow`): train.log's text from the cursor (whole lines, or whole characters
    of a line longer than one answer), the cursor after it (`offset`, `inode`, `check`: a digest of the bytes
    before `offset`), whether the run has ended, why reading started again (`notice`), and whether more is
    there already."""

    data: str
    offset: int
    inode: int
    check: str
    finished: bool
    notice: str | None
    more: bool


@dataclass(kw_only=True, eq=False, repr=False)
class PreflightAnswer(Answer):
    """`preflight` (a dry run's): the pre-flight's verdict (preflight.py: what was checked, how long it took, its
    summary; a dict, as a launch's and a restart's `preflight` carry it), or None with why it was `skipped`."""

    preflight: dict[str, Any] | None
    skipped: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True, eq=False, repr=False)
class RunEntry(Answer):
    """One run of `status` (status.py run_status): its state (running, stopping, launching, lost, crashed,
    stopped, finished), exit codes, processes, progress and files; the last three keys are the supervisor's
    (supervision), there only when it left them. The controller hands entries on as their JSON objects
    (observe, lineage, `status --json`), so those stay what they were."""

    name: str
    state: str
    exit_code: int | None
    launcher_exit_code: int | None
    tmux: dict[str, Any]
    pids: list[int]
    pgid: int | None
    step: int | None
    error_line: str | None
    ended_at: float | None
    trainer_status: dict[str, Any] | None
    last_metrics: dict[str, Any] | None
    last_log_line: str | None
    checkpoints: list[str]
    run_dir: str
    run_json: dict[str, Any]
    restarted_as: str | None = field(default=None, metadata=OPTIONAL)
    events: list[dict[str, Any]] | None = field(default=None, metadata=OPTIONAL)
    supervisor: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True, eq=False, repr=False)
class StatusAnswer(Answer):
    """`status`: the runs read, and with `ended_within_s` how many ended longer ago (counted, not read)."""

    runs: list[RunEntry]
    older_runs: int | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True, eq=False, repr=False)
class StopAnswer(Answer):
    """`stop` (and a restart's `stop`): how the run's processes were stopped. Its shapes share the keys from
    `escalated` on; the others are there only in some:
    - a stop that did the bookkeeping (stop.py finish_stop, what stop.json records): `launcher_exit_code` (null
      too: no launcher between), `supervisor_cancelled` after a signal, `now` with `stop --now`;
    - a cancelled automatic restart of a run that had ended: `supervisor_cancelled` true, nothing `signalled`;
    - a hand-over (restart --resume): `handover`, the trainer's offer (`checkpoint`, `step`), `exit_code` null:
      the rest of the stop finishes in the background;
    - `stop --now` while another command holds the run: `now`, `recorded` null (that command records the end);
    - a stop that met another stop or restart (`joined`: op, pid, since, outcome, finished_at): that one's
      outcome, with the run's `state` and its last checkpoint (`checkpoints`).
    The order is the dataclass's: a `now` stop's keys come in another order than its dict gave (same keys and
    values); nothing prints a stop's answer as JSON."""

    joined: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    state: str | None = field(default=None, metadata=OPTIONAL)
    handover: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    now: bool | None = field(default=None, metadata=OPTIONAL)
    escalated: bool
    signalled: list[int]
    gpu_released: bool | None
    waited_for_checkpoint_s: float
    before_start: bool
    exit_code: int | None
    launcher_exit_code: int | None = field(default=None, metadata=OPTIONAL)
    checkpoints: list[str] | None = field(default=None, metadata=OPTIONAL)
    seconds: float
    recorded: bool | None
    supervisor_cancelled: bool | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True, eq=False, repr=False)
class LaunchAnswer(Answer):
    """`launch`: where the run is, its group (None: not recorded in time) and marker, how it was started
    (`standby`: a standby interpreter took it), the pre-flight's verdict (preflight.py; a dict, None when none
    ran) and what clearing the compile cache removed (None: not asked)."""

    run_dir: str
    pgid: int | None
    marker: str
    launcher: str
    session: str
    standby: bool
    preflight: dict[str, Any] | None
    cleared: ClearCacheAnswer | None


@dataclass(kw_only=True, eq=False, repr=False)
class RestartAnswer(Answer):
    """`restart`: the old run's stop (None: it had ended already) and its status after it, the release made
    current (hash, folder) and the old releases pruned, the checkpoint the new run resumes (None: fresh), then
    the new run's launch answer (LaunchAnswer's keys, in its order), with the restart's pre-flight verdict and
    cache clearing."""

    stop: StopAnswer | None
    old_status: RunEntry
    release: str
    path: str
    removed: list[str]
    checkpoint: str | None
    run_dir: str
    pgid: int | None
    marker: str
    launcher: str
    session: str
    standby: bool
    preflight: dict[str, Any] | None
    cleared: ClearCacheAnswer | None


ENTRIES: dict[str, type[Answer]] = {
    "GpuEntry": GpuEntry,
    "RemovedEntry": RemovedEntry,
    "FetchFile": FetchFile,
    "RunEntry": RunEntry,
    "ClearCacheAnswer": ClearCacheAnswer,
    "StopAnswer": StopAnswer,
}
ANSWERS: dict[str, type[Answer]] = {
    "ping": PingAnswer,
    "gpus": GpusAnswer,
    "status": StatusAnswer,
    "tail": TailAnswer,
    "preflight": PreflightAnswer,
    "follow": TailAnswer,
    "manifest": ManifestAnswer,
    "install": InstallAnswer,
    "clear-cache": ClearCacheAnswer,
    "gc": GcAnswer,
    "fetch-manifest": FetchManifestAnswer,
    "stop": StopAnswer,
    "launch": LaunchAnswer,
    "restart": RestartAnswer,
}


def answer_json(answer: Answer) -> dict[str, Any]:
    """The JSON object of an answer (without `ok`): every field in order, an OPTIONAL one only when it is not
    None, nested entries as objects. A shallow walk, not dataclasses.asdict (which deep-copies every value)."""
    out: dict[str, Any] = {}
    for each in fields(answer):
        value = getattr(answer, each.name)
        if value is None and each.metadata.get("optional") and each.name not in answer.nulls:
            continue
        if isinstance(value, Answer):
            value = answer_json(value)
        elif isinstance(value, list) and value and isinstance(value[0], Answer):
            value = [answer_json(item) for item in value]
        out[each.name] = value
    return out


def parse_answer(verb: str, cls: type[Answer], obj: dict[str, Any], prefix: str = "") -> Any:
    """`obj` (an answer's JSON object; its `ok` is skipped) as an instance of `cls`, or AnswerMismatch naming
    `verb` and the first unknown, missing or mistyped key (a nested entry's as `runs[0].KEY`)."""
    names, shape = shape_of(cls)
    for key in obj:
        if key not in names and not (key == "ok" and not prefix):
            raise AnswerMismatch(f"{verb} answer: unknown key '{prefix}{key}'")
    values = {}
    nulls = []
    for name, required, allowed, want, listed, single in shape:
        if name not in obj:
            if required:
                raise AnswerMismatch(f"{verb} answer: missing key '{prefix}{name}'")
            continue
        value = obj[name]
        if value is None and not required:
            nulls.append(name)
        if not isinstance(value, allowed):
            raise AnswerMismatch(f"{verb} answer: key '{prefix}{name}' must be {want}, not {type(value).__name__}")
        if listed is not None and isinstance(value, list):
            value = [entry_of(verb, listed, item, f"{prefix}{name}[{i}].") for i, item in enumerate(value)]
        elif single is not None and isinstance(value, dict):
            value = parse_answer(verb, single, value, f"{prefix}{name}.")
        values[name] = value
    answer = cls(**values)
    if nulls:
        answer.nulls = frozenset(nulls)
    return answer


# Per answer class: its keys, and per field (name, required, the JSON types allowed, their words for a refusal,
# the entry class of a list of entries, the entry class of one entry). Read from the annotations once: doing
# it per object made parsing a status of 1,000 runs cost ~31 ms of the controller's CPU instead of ~6 ms.
Shape = tuple[str, bool, tuple[type, ...], str, "type[Answer] | None", "type[Answer] | None"]
SHAPES: dict[type[Answer], tuple[frozenset[str], list[Shape]]] = {}


def shape_of(cls: type[Answer]) -> tuple[frozenset[str], list[Shape]]:
    """`cls`'s keys and fields as parse_answer checks them (SHAPES, filled on first use)."""
    known = SHAPES.get(cls)
    if known is None:
        shape: list[Shape] = []
        for each in fields(cls):
            words = [word.strip() for word in str(each.type).split("|")]
            allowed = tuple(kind for word in words for kind in JSON_TYPES.get(word.split("[", 1)[0], (dict,)))
            listed = next((ENTRIES[w[5:-1]] for w in words if w.startswith("list[") and w[5:-1] in ENTRIES), None)
            single = next((ENTRIES[w] for w in words if w in ENTRIES), None)
            required = each.default is MISSING and each.default_factory is MISSING
            shape.append((each.name, required, allowed, " or ".join(words), listed, single))
        known = SHAPES[cls] = (frozenset(each[0] for each in shape), shape)
    return known


def entry_of(verb: str, cls: type[Answer], item: object, prefix: str) -> Answer:
    """One element of a list of entries, which must be an object."""
    if not isinstance(item, dict):
        raise AnswerMismatch(f"{verb} answer: '{prefix[:-1]}' must be dict, not {type(item).__name__}")
    return parse_answer(verb, cls, item, prefix)
