"""dflashops agent: a stdlib-only program that runs inside the target with its own python3.

Contract: `python3 agent-<sha12>.pyz VERB [--json-args JSON | --json-stdin]` prints exactly ONE JSON line on stdout,
`{"ok": true, ...}` or `{"ok": false, "error": "...", "code": "..."}`, and exits 0 either way (exit 2 only
for a request that could not even be parsed, still with its JSON line). The controller trusts the JSON line,
never the exit status, because ssh (255) and pct/lxc-attach (1) make exit codes ambiguous. The one
exception is `follow`, which streams one such line per answer (see verb_follow).

A request is one JSON object, parsed once here into its verb's dataclass (protocol.py): a key the verb does
not know, a required key that is missing, or a value of the wrong type is one `bad_request` naming the verb
and the key, before the verb runs. A verb answers with its answer's dataclass (answers.py), printed as its JSON
object (`answer_json`); `ping` (read by key before the protocol is known to match) and the internal `wrap`
and `standby` (an exit code, not an answer) return dicts. With `--json-stdin` the request is read from stdin (launch uses this so
that secrets in the environment of the launched process never appear on a command line). `install` and `restart` read one JSON request line
from stdin, then the tar stream of the changed files.

Verbs: ping, launch, stop, status, tail, follow (tail, streamed), gpus, clear-cache, manifest, install, restart (stop + install +
launch in one call), gc, and the internal `wrap` (the launch wrapper that records pid/pgid/exit code) and
`supervise start --json-stdin` (the auto-recovery supervisor's daemon, supervisor.py: its own answer, one line). This module dispatches them to the package's modules, one
per concern. It runs with whatever python3 the container has, so the package imports the standard library only;
it travels as one zipapp built from the package (ops/agent_build.py), whose own __main__ calls `main` here.

Also runnable as `python3 -m dflashops.agent VERB ...` or, from a checkout, `python3 <checkout>/dflashops/agent
VERB ...` (the folder itself: what the agent runs to start itself again there, common.program).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

if not __package__:  # run as a folder: sys.path[0] is this folder; the package lives two levels up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflashops.agent.common import AgentFailure
from dflashops.agent.protocol import PROTOCOL_VERSION, PingRequest, parse

# verb -> (module, function). A call imports only its verb's module and what that imports: zipimport keeps no
# bytecode, so every agent call compiles what it imports. Importing all of the package cost ~136 ms a call on
# the loaded 2-core dev machine; per verb, `status` costs ~35 ms over a bare interpreter's start, `ping` ~29 ms.
# Every call also parses its request (protocol.py): the stdlib `dataclasses` import (with `inspect`) and the
# request classes' creation cost ~15 ms of CPU a call on that machine when measured under a load of ~10
# (ping 66 -> 81 ms, status 82 -> 99 ms of CPU, 50 calls each); about 6 ms of it is the import itself.
VERBS = {
    "ping": ("", "verb_ping"),
    "launch": ("launch", "verb_launch"),
    "stop": ("stop", "verb_stop"),
    "status": ("status", "verb_status"),
    "tail": ("follow", "verb_tail"),
    "follow": ("follow", "verb_follow"),
    "gpus": ("status", "verb_gpus"),
    "clear-cache": ("gc", "verb_clear_cache"),
    "manifest": ("releases", "verb_manifest"),
    "gc": ("gc", "verb_gc"),
    "wrap": ("launch", "verb_wrap"),
    "standby": ("standby", "verb_standby"),
    "fetch-manifest": ("fetch_files", "verb_fetch_manifest"),
    "preflight": ("preflight", "verb_preflight"),
}
# Verbs whose answer is raw bytes on stdout (a refusal: JSON on stderr, exit 3).
RAW_VERBS = {"read-file": ("fetch_files", "verb_read_file")}

# Verbs whose stdin is one JSON request line followed by a tar stream.
STDIN_VERBS = {"install": ("releases", "verb_install"), "restart": ("restart", "verb_restart")}


def verb_ping(req: PingRequest) -> dict:
    """The protocol version this agent speaks (the controller refuses another one) and its python's. A dict,
    not an answers.py class: the controller reads `version` by its key before it knows the agent speaks its
    protocol (an agent of another version may answer other keys), then checks the rest as a PingAnswer."""
    return {"version": PROTOCOL_VERSION, "python": sys.version.split()[0]}


def verb_function(entry: tuple[str, str]) -> Callable:
    """The function of a verb table's entry, its module imported now ("" = this module)."""
    module, name = entry
    return getattr(importlib.import_module(f"dflashops.agent.{module}"), name) if module else globals()[name]


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    if verb == "supervise":  # a daemon with its own protocol (one JSON line from its start), not a request verb
        from dflashops.agent import supervisor

        return supervisor.main(argv[1:])
    try:
        if verb not in STDIN_VERBS and verb not in VERBS and verb not in RAW_VERBS:
            raise AgentFailure(
                f"unknown verb {verb!r}; verbs: {', '.join(sorted([*VERBS, *STDIN_VERBS, *RAW_VERBS]))}", "bad_request"
            )
        stdin: bytes | io.BufferedIOBase = b""
        if verb in STDIN_VERBS:  # stdin: one JSON request line, then the tar stream (no argv length limits)
            # Only the line is read here: the verb reads the tar as it arrives, never whole (a 200 MB upload was
            # held in memory twice over, bench/results/control-plane.md "2026-12-05 — The control plane at scale").
            raw = sys.stdin.buffer.readline().decode("utf-8", errors="replace")
            stdin = sys.stdin.buffer  # type: ignore[assignment]  # a BufferedReader (typeshed: BinaryIO)
        elif "--json-args" in argv[1:]:
            raw = argv[argv.index("--json-args") + 1] if argv.index("--json-args") + 1 < len(argv) else ""
        elif "--json-stdin" in argv[1:]:
            raw = sys.stdin.read()
        else:
            raw = "{}"
        try:
            req = json.loads(raw)
        except ValueError as exc:
            raise AgentFailure(f"request is not valid JSON: {exc}", "bad_request") from None
        if not isinstance(req, dict):
            raise AgentFailure("request must be a JSON object", "bad_request")
        if verb in RAW_VERBS:  # its refusals, a bad request's too, go to stderr
            return raw_call(verb_function(RAW_VERBS[verb]), verb, req)
        req = parse(verb, req)  # the one place a request's keys are read: unknown, missing, mistyped -> refused
        if verb in STDIN_VERBS:
            result = verb_function(STDIN_VERBS[verb])(req, stdin)
        else:
            result = verb_function(VERBS[verb])(req)
        if verb in ("wrap", "standby"):
            return int(result["exit_code"])
        if isinstance(result, dict) and result.get("streamed"):  # `follow` printed its answers itself
            return 0
        print(json.dumps({"ok": True, **answer_json(result)}), flush=True)
        return 0
    except BrokenPipeError:  # the reader of a `follow` stream went away: nothing to tell anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 0
    except KeyboardInterrupt:
        # Ctrl-C in the terminal of a local-target `logs -f` reaches this process too (same process group): the
        # CLI says what to do next; a traceback from here would only bury that line. Its reader is going away.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGINT
    except AgentFailure as exc:
        print(json.dumps({"ok": False, "error": str(exc), "code": exc.code}), flush=True)
        return 2 if exc.code == "bad_request" else 0
    except Exception as exc:
        if not isinstance(exc, EXPECTED_ERRORS) and not is_tar_error(exc):
            raise
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "code": "internal"}), flush=True)
        return 0


EXPECTED_ERRORS = (OSError, subprocess.SubprocessError, KeyError, ValueError, TypeError, EOFError)


def is_tar_error(exc: BaseException) -> bool:
    """A tarfile error (a bad upload), checked without importing tarfile: only `sync`'s verbs import it, and
    ~10 ms of every other call's start went to it (issue 46 item 7). Not imported means none was raised."""
    tar = sys.modules.get("tarfile")
    return tar is not None and isinstance(exc, tar.TarError)


def answer_json(result: Any) -> dict:
    """A verb's answer as its JSON object: an answer dataclass (answers.py) through its `answer_json`, a dict
    (`ping`) as it is. Checked without importing answers.py: a verb whose answer is one imported it, and
    `ping` does not pay its import (answers.py)."""
    answers = sys.modules.get("dflashops.agent.answers")
    return answers.answer_json(result) if answers is not None and isinstance(result, answers.Answer) else result


def raw_call(function: Callable, verb: str, obj: dict) -> int:
    """Run a RAW verb on request `obj` (parsed here): its refusals go to stderr (stdout carries only data), exit
    status 3."""
    try:
        function(parse(verb, obj))
        return 0
    except AgentFailure as exc:
        sys.stderr.write(json.dumps({"ok": False, "error": str(exc), "code": exc.code}) + "\n")
    except (OSError, ValueError, TypeError, KeyError) as exc:
        sys.stderr.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "code": "internal"}) + "\n")
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
