"""Calling the agent on a target: upload it once (content-addressed), run one verb, parse its one JSON line.

The agent lives at `<workspace>/.dflashops/agent-<sha12>.pyz` on the target (one zipapp built from the package
dflashops/agent/: ops/agent_build.py), so a changed agent is a new file and two controller versions never overwrite each other's agent mid-call. In dry-run mode mutating
calls are recorded as the exact command lines they would run (secrets replaced), and read-only calls run.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dflashops.agent.answers import Answer, AnswerMismatch, PingAnswer, parse_answer
from dflashops.agent.answers import ClearCacheAnswer as ClearCacheAnswer  # named here for cli and playbook, which
from dflashops.agent.answers import GcAnswer as GcAnswer  # never import the agent's package (test_boundaries.py)
from dflashops.agent.answers import GpusAnswer as GpusAnswer
from dflashops.agent.answers import StatusAnswer as StatusAnswer
from dflashops.agent.answers import StopAnswer as StopAnswer
from dflashops.agent.answers import answer_json as answer_json
from dflashops.agent.common import AgentFailure, tmux_socket  # the agent names the tmux server; its function agrees
from dflashops.agent.protocol import PROTOCOL_VERSION, REQUESTS, Request, parse, wire
from dflashops.core.errors import AgentError, Conflict, DflashopsError, InventoryError, NotFound, UsageError
from dflashops.core.inventory import Target
from dflashops.core.shell import join_argv
from dflashops.ops.agent_build import PACKAGE, build_zipapp
from dflashops.ops.upload import CHUNK, RequestAndTar, Tar
from dflashops.transport.base import Result, Stdin, Transport

A = TypeVar("A", bound=Answer)
AGENT_SOURCE = PACKAGE  # the package folder; python runs it as the agent from a checkout (local_runs)
READ_ONLY_VERBS = {"ping", "status", "tail", "gpus", "manifest", "fetch-manifest", "preflight"}
# Writes stdin to argv[1] atomically; stdlib only, argv-only so no shell quoting is involved.
_UPLOAD = (
    "import os,sys\np=sys.argv[1];os.makedirs(os.path.dirname(p),exist_ok=True)\n"
    "t=p+'.tmp'+str(os.getpid());open(t,'wb').write(sys.stdin.buffer.read());os.replace(t,p)"
)


class StaleRelease(Conflict):
    """The agent refused an install built against a base release it no longer has (code `stale_release`):
    the controller's cached view of the target is out of date. Nothing was changed; ask `manifest`, retry."""


class Busy(Conflict):
    """Another command is stopping or restarting the same run, and went on longer than this one would wait (code
    `busy`): nothing was done."""


class Superseded(Conflict):
    """Two restarts of one run met: the other one restarted it first (code `superseded`); nothing was done."""


class Unchecked(UsageError):
    """A restart of a job the pre-flight could only compile (not the trainer, no profile `check:`) whose old run
    is alive, without `unchecked` (code `unchecked`): nothing was stopped (ops/runs/restart.py words it)."""


_CODE_TO_ERROR = {
    "unchecked": Unchecked,
    "not_found": NotFound,
    "conflict": Conflict,
    "bad_request": UsageError,
    "stale_release": StaleRelease,
    "busy": Busy,
    "superseded": Superseded,
}
# tmux's own words for a launch that lost a race to a session of the same name, and the agent's for one it
# refused before taking the run's name.
DUPLICATE_SESSION = re.compile(r"duplicate session: (\S+)|a tmux session named '([^']+)' already exists")


def refusal(answer: dict[str, Any], target: Target, args: dict[str, Any]) -> DflashopsError:
    """The typed error of an agent's `{"ok": false}` answer, with a hint where the fix is known."""
    error = str(answer.get("error", "agent failed"))
    code = str(answer.get("code"))
    if code == "preflight":  # the new code's own `error:` and `hint:` lines (agent.preflight_release)
        return PreflightFailed.from_lines(target.name, error)
    hint = None
    duplicate = DUPLICATE_SESSION.search(error) if code in ("launch_failed", "conflict") else None
    if duplicate:  # a session of the run's session name is on the workspace's tmux server already
        session = duplicate.group(1) or duplicate.group(2)
        socket = tmux_socket(str(args.get("workspace") or target.workspace))
        taken = " (this one now records the failed launch)" if code == "launch_failed" else ""
        hint = (
            f"look at the session {session!r} with `tmux -L {socket} ls` there (from here: `dflashops exec "
            f"{target.name} -- tmux -L {socket} ls`); launch under another --name{taken}, or with --launcher nohup"
        )
    if code == "no_space":  # the workspace's disk (agent/launch.py check_space): nothing launched, nothing stopped
        workspace = str(args.get("workspace") or target.workspace)
        hint = (
            f"free space on the disk of {workspace} on {target.name} (`dflashops gc {target.name} --keep 3 "
            "--dry-run` lists old releases to delete), then run the command again"
        )
    return _CODE_TO_ERROR.get(code, AgentError)(f"{target.name}: {error}", hint=hint)


class PreflightFailed(UsageError):
    """The new code or its flags would not start (the agent's pre-flight, code `preflight`): nothing was
    stopped or launched."""

    @classmethod
    def from_lines(cls, target: str, text: str) -> PreflightFailed:
        lines = text.splitlines()
        error = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")), text)
        hint = next((ln.removeprefix("hint: ") for ln in lines if ln.startswith("hint: ")), None)
        return cls(
            f"{target}: pre-flight of the new code: {error}",
            hint=(hint + "; " if hint else "") + "the old run was not touched (--skip-preflight skips this check)",
        )


def agent_bytes() -> bytes:
    """The agent's zipapp, built from the package as it is now."""
    return build_zipapp()


def readable_json(value: Any, depth: int = 1) -> str:
    """JSON for a dry-run plan: every object one key per line (sorted), indented under its command; lists on one
    line (an argv reads as a command). Still one valid JSON value: a deploy's launch request was one ~2,000-character
    line (issue 46 item 11)."""
    if not isinstance(value, dict) or not value:
        return json.dumps(value, sort_keys=True)
    pad = "    " * depth
    items = [f"{pad}{json.dumps(key)}: {readable_json(value[key], depth + 1)}" for key in sorted(value)]
    return "{\n" + ",\n".join(items) + "\n" + "    " * (depth - 1) + "}"


@dataclass
class Agent:
    """The agent on one target, reached through `transport`."""

    target: Target
    transport: Transport
    dry_run: bool = False
    plan: list[str] = field(default_factory=list)
    _ready: bool = False
    _upload_planned: bool = False
    # Read once: a long `logs -f` must keep calling the agent it uploaded even if the package is edited
    # meanwhile (the path is content-addressed, so re-reading would name a file that was never uploaded).
    source: bytes = field(default_factory=agent_bytes)

    @property
    def path(self) -> str:
        digest = hashlib.sha256(self.source).hexdigest()[:12]
        return f"{self.target.workspace}/.dflashops/agent-{digest}.pyz"

    def argv(self, verb: str, args: dict[str, Any] | None = None, *, stdin_request: bool = False) -> list[str]:
        argv = [self.target.python, self.path, verb]
        if stdin_request:
            argv.append("--json-stdin")
        elif args is not None:
            argv += ["--json-args", json.dumps(args, sort_keys=True)]
        return argv

    def record(self, argv: list[str], stdin_note: str | None = None) -> None:
        line = join_argv(argv)
        self.plan.append(f"[{self.target.name}] {line}" + (f"  < {stdin_note}" if stdin_note else ""))

    def ensure(self) -> None:
        """Upload the agent when the target lacks this exact version (one cheap `ping` otherwise)."""
        if self._ready:
            return
        probe = self._run(self.argv("ping"))
        pong = _parse(probe.stdout, probe.stderr, "ping", self.target.name)
        if pong.get("ok") and pong.get("version") != PROTOCOL_VERSION:
            raise AgentError(
                f"{self.target.name}: the agent at {self.path} speaks protocol {pong.get('version')}, "
                f"this controller speaks protocol {PROTOCOL_VERSION}",
                hint=f"remove {self.path} on the target; the next call uploads this controller's agent",
            )
        if pong.get("ok"):  # the same version: its answer is this controller's PingAnswer (checked, as every answer)
            checked(self.target.name, "ping", PingAnswer, pong)
        else:
            upload = [self.target.python, "-c", _UPLOAD, self.path]
            if self.dry_run:
                if not self._upload_planned:
                    self.record(upload, "agent.pyz")
                    self._upload_planned = True
                return
            self._upload()
        self._ready = True

    def _run(self, argv: list[str], stdin: Stdin = None, on_stderr: Callable[[bytes], None] | None = None) -> Result:
        """One command with the target's python; a python that cannot be started there (exit 126/127 that
        names it: missing, not executable) is an InventoryError about the `python:` setting, not a dump of
        the command line."""
        result = self.transport.run(argv, stdin=stdin, check=False, on_stderr=on_stderr)
        python = self.target.python
        if result.exit_code in (126, 127) and python in result.stderr:
            detail = (result.stderr.strip().splitlines() or [""])[-1].strip()
            where = f"in container {self.target.ctid}" if self.target.ctid is not None else f"on {self.target.name}"
            raise InventoryError(
                f"{self.target.name}: the target's python {python} cannot be run {where} ({detail})",
                hint=f"set `python:` of target {self.target.name} in the inventory to an interpreter that exists "
                f"there (python3, or a venv's bin/python)",
            )
        return result

    def _upload(self) -> None:
        """Write this agent version to the target (atomic: a temporary name, then a rename)."""
        result = self._run([self.target.python, "-c", _UPLOAD, self.path], stdin=self.source)
        if not result.ok:
            detail = (result.stderr.strip().splitlines() or ["no output"])[-1].strip()
            raise AgentError(
                f"{self.target.name}: could not write the agent to {self.path}: {detail}",
                hint=f"check that {self.target.workspace} exists or can be created there and has free space",
            )

    def ask(
        self,
        verb: str,
        args: Request | dict[str, Any],
        kind: type[A],
        *,
        secret_args: dict[str, Any] | None = None,
        shown_args: dict[str, Any] | None = None,
        stdin_tar: Tar | bytes | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> A | None:
        """`call`, its answer parsed into `kind`, the verb's answer dataclass (agent/answers.py): an unknown,
        missing or mistyped key is one AgentError naming the target, the verb and the key. None when a dry run
        only planned the call (a mutating verb, or a read-only one before the agent is on the target)."""
        answer = self.answer(
            verb, args, secret_args=secret_args, shown_args=shown_args, stdin_tar=stdin_tar, on_progress=on_progress
        )
        return None if answer is None else checked(self.target.name, verb, kind, answer)

    def call(
        self,
        verb: str,
        args: Request | dict[str, Any],
        *,
        secret_args: dict[str, Any] | None = None,
        shown_args: dict[str, Any] | None = None,
        stdin_tar: Tar | bytes | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Run one verb; return its JSON answer (`{"ok": true, "dry_run": true}` when a dry run only planned it).
        `secret_args` travel on stdin (never on a command line); the dry-run plan shows `shown_args` (their
        redacted form) in their place. Raises NotFound / Conflict / UsageError / AgentError from the agent's error
        code. `on_progress` gets each phase the verb reports as it starts (`restart`, `launch`: the request gets
        `progress: true`), as the transport delivers stderr: live on local and ssh targets, through a multiplexer
        too. `args` is the verb's request (agent/protocol.py), or its JSON object, checked against it here: a
        wrong key fails before any call. The controller reads a verb's answer with `ask`, as its dataclass; this is
        the agent's line as printed, which tests compare."""
        answer = self.answer(
            verb, args, secret_args=secret_args, shown_args=shown_args, stdin_tar=stdin_tar, on_progress=on_progress
        )
        return {"ok": True, "dry_run": True} if answer is None else answer

    def answer(
        self,
        verb: str,
        args: Request | dict[str, Any],
        *,
        secret_args: dict[str, Any] | None = None,
        shown_args: dict[str, Any] | None = None,
        stdin_tar: Tar | bytes | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any] | None:
        """`call`'s work: the verb's JSON answer, or None when a dry run only planned it."""
        args = request_json(verb, args, secret_args)
        if on_progress is not None:
            args = {**args, "progress": True}
        if self.dry_run:
            try:
                self.ensure()
            except AgentError:
                pass
        stdin: Stdin
        if stdin_tar is not None and secret_args is not None:  # restart: request with secrets, then the tar
            argv = self.argv(verb)
            stdin = with_tar(json.dumps({**args, **secret_args}).encode() + b"\n", stdin_tar)
            shown = shown_args if shown_args is not None else {k: "<redacted>" for k in secret_args}
            note = "request JSON: " + readable_json({**args, **shown}) + f" + tar of {len(stdin_tar)} bytes"
        elif stdin_tar is not None:
            argv, stdin = self.argv(verb), with_tar(json.dumps(args).encode() + b"\n", stdin_tar)
            note = f"install request + tar of {len(stdin_tar)} bytes"
        elif secret_args is not None:
            argv, stdin = self.argv(verb, stdin_request=True), json.dumps({**args, **secret_args}).encode()
            shown = shown_args if shown_args is not None else {k: "<redacted>" for k in secret_args}
            note = "request JSON: " + readable_json({**args, **shown})
        else:
            argv, stdin, note = self.argv(verb, args), None, None
        if self.dry_run and (verb not in READ_ONLY_VERBS or not self._ready):
            self.record(argv, note)
            return None
        sink = ProgressLines(on_progress) if on_progress is not None else None
        result = self._run(argv, stdin, sink)
        if not self._ready and result.exit_code == 2 and "can't open file" in result.stderr:
            # Optimistic first call (no `ping` round trip, ~0.3-0.5 s per invocation on a remote target):
            # this agent version is not on the target yet, so upload it and run the call again.
            self._upload()
            result = self._run(argv, again(stdin), sink)
        self._ready = True
        answer = _parse(result.stdout, result.stderr, verb, self.target.name)
        if answer.get("code") == "no_answer" and verb in READ_ONLY_VERBS:
            self._ready = False  # the agent file vanished (workspace cleaned?): upload again, retry once
            self.ensure()
            result = self._run(argv, again(stdin))
            answer = _parse(result.stdout, result.stderr, verb, self.target.name)
        if not answer.get("ok"):
            raise refusal(answer, self.target, args)
        return answer

    def stream(self, verb: str, args: Request | dict[str, Any]) -> Iterator[dict[str, Any]]:
        """A streaming verb (`follow`): yield its JSON answer lines as they arrive. Ends when the agent does;
        a lost link raises TransportError mid-iteration; closing the generator ends the remote command.
        The stream's stderr and exit status are not seen here: a caller whose stream ends before its last
        answer asks a one-shot verb next, which reports whatever stopped it (a stopped container, ...)."""
        args = request_json(verb, args)
        self.ensure()  # a stream cannot be replayed after "can't open file", so the agent must be there first
        pending = b""
        for chunk in self.transport.stream(self.argv(verb, args)):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                answer = _parse(line.decode("utf-8", errors="replace"), "", verb, self.target.name)
                if not answer.get("ok"):
                    raise refusal(answer, self.target, args)
                yield answer


def checked(target: str, verb: str, kind: type[A], answer: dict[str, Any]) -> A:
    """`answer` (an `ok` JSON answer) as `verb`'s answer dataclass `kind`, or AgentError naming the key that
    this controller and the target's agent disagree on (agent/answers.py parse_answer)."""
    try:
        parsed: A = parse_answer(verb, kind, answer)
    except AnswerMismatch as exc:
        raise AgentError(
            f"{target}: the agent's answer does not fit this controller: {exc}",
            hint="the agent there is built from this controller's own package (its path is its content's hash), so "
            "its verb and agent/answers.py disagree: a bug to report",
        ) from None
    return parsed


def request_json(
    verb: str, args: Request | dict[str, Any], secret_args: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON object of a request (its dataclass's `wire` form; a dict as it is), after the agent's own check of
    the keys built outside a request class: a dict's and the secrets that travel beside it (`protocol.parse`,
    partial: a missing key is the agent's to refuse). An unknown or mistyped key is a UsageError here, before a
    round trip; a dataclass's own fields need no second check."""
    obj, unchecked = (wire(args), {}) if isinstance(args, Request) else (args, args)
    unchecked = {**unchecked, **(secret_args or {})}
    if verb not in REQUESTS or not unchecked:  # not in REQUESTS: a protocol of its own (`supervise start`)
        return obj
    try:
        parse(verb, unchecked, partial=True)
    except AgentFailure as exc:
        raise UsageError(f"agent request: {exc}") from None
    return obj


def with_tar(head: bytes, tar: Tar | bytes) -> Stdin:
    """A call's stdin: the request line, then the tar, read from the tar's file as it is sent (upload.py)."""
    return head + tar if isinstance(tar, bytes) else io.BufferedReader(RequestAndTar(head, tar), CHUNK)


def again(stdin: Stdin) -> Stdin:
    """The same stdin for a second run of a call, from its start (a file-backed one was read by the first)."""
    raw = getattr(stdin, "raw", None)
    return io.BufferedReader(raw.again(), CHUNK) if isinstance(raw, RequestAndTar) else stdin


# The agent's progress lines on stderr (agent/common.py report_progress).
PROGRESS_PREFIX = b"dflashops-progress "


class ProgressLines:
    """A stderr sink: whole lines that carry PROGRESS_PREFIX become `on_progress(event)`; other bytes are left
    to the Result's stderr as before."""

    def __init__(self, on_progress: Callable[[dict[str, Any]], None]) -> None:
        self.on_progress = on_progress
        self.pending = b""

    def __call__(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            if not line.startswith(PROGRESS_PREFIX):
                continue
            try:
                event = json.loads(line[len(PROGRESS_PREFIX) :])
            except ValueError:
                continue
            if isinstance(event, dict):
                self.on_progress(event)


def _parse(stdout: str, stderr: str, verb: str, target: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if len(lines) != 1:
        detail = (stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "code": "no_answer", "error": f"agent {verb} gave no JSON answer: {detail}"}
    try:
        answer = json.loads(lines[0])
    except ValueError:
        raise AgentError(f"agent {verb} on {target} printed something that is not JSON: {lines[0][:200]!r}") from None
    if not isinstance(answer, dict):
        raise AgentError(f"agent {verb} on {target} answered {answer!r}, not an object")
    return answer
