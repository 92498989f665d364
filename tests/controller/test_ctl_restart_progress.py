"""`deploy` and `restart` say what they are doing as it happens (issue 46 item 1): `dflashops` typed as a user
types it (a real process; its stderr read line by line as it comes), the real tiny trainer on the local target.
Each phase is a line as it starts, in the order it happens; the pre-flight's first line comes while the
pre-flight runs (before its verdict, by about the check's own seconds), not all at once at the end; the last
line names the checkpoint the child resumed from (a hand-over's final one); `--json` gives the same phases as
JSON events on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.controller.helpers import REPO, Env
from tests.controller.test_ctl_reliability import add_profile
from tests.controller.test_ctl_restart_unchecked import PLAIN

pytestmark = pytest.mark.slow

PROFILE = """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "off", --log-interval, "1", --save-interval, "5"]
resume_args: [--resume, "{checkpoint}"]
env: {TRAINER_TEST_MIN_STEP_S: "0.1"}
"""


def typed(env: Env, *args: str) -> tuple[int, str, list[tuple[float, str]]]:
    """`dflashops ARGS` as a process: (exit code, stdout, [(seconds since start, line)] of stderr as it came)."""
    began = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=env.root,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic() - began, line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    assert proc.stdout is not None
    out = proc.stdout.read()  # not communicate(): it would read stderr too, taking lines from the reader
    proc.wait(timeout=300)
    reader.join()
    return proc.returncode, out, lines


def in_order(lines: list[tuple[float, str]], *starts: str) -> list[float]:
    """The arrival times of the first lines that start with each of `starts`, which must come in that order."""
    texts = [text for _, text in lines]
    found, at = [], 0
    for start in starts:
        index = next((i for i in range(at, len(texts)) if texts[i].startswith(start)), None)
        assert index is not None, f"no line starting {start!r} after line {at}:\n" + "\n".join(texts)
        found.append(lines[index][0])
        at = index + 1
    return found


def test_deploy_and_restart_say_each_phase_as_it_starts(env: Env) -> None:
    add_profile(env, "tinyprog", PROFILE)
    code, out, lines = typed(env, "deploy", "--profile", "tinyprog", "--name", "pg1", "--launcher", "nohup")
    assert code == 0 and out.strip() == "pg1", lines
    in_order(
        lines,
        "syncing the code to local",
        "pre-flight: importing the trainer, checking its arguments",
        "pre-flight: ok: ",
        "launching pg1",
        "launched pg1 on local",
        "waiting for pg1's first step",
        "pg1 passed its start: status.json timeline `first_step`",
    )

    code, out, lines = typed(env, "restart", "pg1", "--resume", "--name", "pg2")
    assert code == 0 and out.strip() == "pg2", lines
    times = in_order(
        lines,
        "syncing 0 changed files to local (code ",
        "pre-flight: importing the trainer, checking its arguments, and its checkpoint ",
        "pre-flight: ok: ",
        "stopping pg1: SIGTERM, then its final checkpoint",
        "pg1 stopped training and is writing its final checkpoint ",
        "launching pg2, resuming from ",
        "launched pg2 on local",
        "waiting for pg2's first step",
        "pg2 passed its start: status.json timeline `first_step`",
    )
    # Said as it happened: the pre-flight's first line came while it ran (its verdict names its own seconds).
    verdict = next(text for _, text in lines if text.startswith("pre-flight: ok: "))
    check_s = float(verdict.rsplit(", ", 1)[1].split(" s)")[0])
    assert times[2] - times[1] > check_s / 2, lines
    # The last line names the checkpoint the child resumed from: the hand-over's final one, which the pre-flight
    # could not have seen (it was written after the stop began).
    resumed = json.loads((env.runs / "pg2" / "run.json").read_text())["extra"]["resumed_from"]
    final = next(text for _, text in lines if text.startswith("pg1 stopped training and is writing its final "))
    assert resumed in final and f"launching pg2, resuming from {resumed}" in [t for _, t in lines]
    assert lines[-1][1].startswith("pg2 passed its start: ") and f"; resumed from {resumed} (" in lines[-1][1]

    # --json: the same phases, as JSON events on stdout, the last one the start.
    code, out, lines = typed(env, "restart", "pg2", "--resume", "--name", "pg3", "--json")
    assert code == 0, lines
    events = [json.loads(line) for line in out.splitlines()]
    phases = [event["phase"] for event in events]
    assert phases == [
        "sync", "preflight", "preflight_done", "stopping", "stopped", "launching", "waiting", "started",
    ], phases  # fmt: skip
    resumed = json.loads((env.runs / "pg3" / "run.json").read_text())["extra"]["resumed_from"]
    assert events[-1]["resumed_from"] == resumed == events[4]["handover"] == events[5]["resume"]
    assert all(isinstance(event["elapsed_s"], float) for event in events)


def test_a_job_the_preflight_cannot_check_says_so(env: Env) -> None:
    """Not the trainer and no `check:` (the `plain` profile's script): its pre-flight only compiles, and says that
    whether it starts is not checked (issue 45 item 1; restart then stops a live parent only with --unchecked:
    test_ctl_restart_unchecked.py)."""
    add_profile(env, "plain", PLAIN)
    code, out, lines = typed(
        env, "deploy", "--profile", "plain", "--name", "wk1", "--launcher", "nohup", "--wait", "step 3"
    )
    assert code == 0, lines
    said = "is not `python -m trainer train` and its profile has no `check:`, so whether it starts"
    assert any(said in text for _, text in lines), lines


PHASES = (
    "from dflashops.cli.deploy import Phases\n"
    "say = Phases(False)\n"
    "say({'phase': 'sync', 'files': 2, 'target': 'local', 'code': 'abc'})\n"
    "say({'phase': 'launching', 'name': 'x2', 'resume': None})\n"
)


def test_on_a_terminal_each_phase_line_carries_the_seconds_since_the_command_began() -> None:
    import pty

    primary, secondary = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PHASES], stderr=secondary, stdout=subprocess.PIPE, env=env, timeout=60)
    os.close(secondary)
    text = b""
    try:
        while chunk := os.read(primary, 4096):
            text += chunk
    except OSError:  # EIO: the terminal's other side is closed and everything was read
        pass
    os.close(primary)
    assert done.returncode == 0
    lines = text.decode().replace("\r", "").splitlines()
    assert [line[9:] for line in lines] == ["syncing 2 changed files to local (code abc)", "launching x2"], lines
    assert all(line.startswith("[") and line[6:9] == "s] " for line in lines), lines
    piped = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, env=env, timeout=60)
    assert piped.stderr.splitlines() == ["syncing 2 changed files to local (code abc)", "launching x2"]
