"""Auto-recovery on the local target, with the real supervisor daemon and real crashing/hanging workloads:
crashes twice then succeeds -> two auto-restarts and a three-run lineage; always crashes -> stops after
max_restarts; a hung workload is stopped within the configured window; `stop` cancels a pending restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashops.agent.common import SUPERVISOR_ARGV
from tests.controller.helpers import Env, all_bytes

SECRET = "sup3r-s3cret-value-for-the-child"


def profile(name: str, extra_argv: str, policy: str) -> str:
    return (
        f"  {name}:\n"
        f'    argv: ["{{python}}", "{{release}}/workload.py", --output-dir, "{{run_dir}}", --interval, "0.02",'
        f" {extra_argv}]\n"
        f'    files: [workload.py]\n    packages: []\n    resume_args: [--resume-from, "{{checkpoint}}"]\n'
        f"    pass_env: [WORKLOAD_SECRET]\n{policy}"
    )


@pytest.fixture
def sup(env: Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    counter = env.root / "starts"
    env.inventory.write_text(
        env.inventory.read_text()
        + "".join(
            [
                profile(
                    "flaky",
                    f'--steps, "30", --save-every, "5", --crash-at, "12", --crash-times, "2", '
                    f'--state-file, "{counter}"',
                    "    on_failure: {resume: true, max_restarts: 3, backoff: 0.2s}\n",
                ),
                profile(
                    "broken",
                    '--steps, "30", --save-every, "5", --crash-at, "7"',
                    "    on_failure: {max_restarts: 2, backoff: 0.1s}\n",
                ),
                profile(
                    "hung",
                    '--steps, "1000", --hang-after, "5"',
                    "    stall: {heartbeat: 1.5s, grace: 5s}\n    on_failure: {max_restarts: 0}\n",
                ),
                profile("slow", '--steps, "30", --crash-at, "3"', "    on_failure: {max_restarts: 3, backoff: 1h}\n"),
                profile(
                    "stuck",
                    '--steps, "1000", --hang-after, "5", --beat-while-hung',
                    "    stall: {heartbeat: 1.5s, grace: 5s}\n",
                ),
                profile(
                    "gated",
                    f'--steps, "100000", --crash-file, "{env.root / "crash-now"}", --crash-times, "1", '
                    f'--state-file, "{counter}"',
                    "    on_failure: {max_restarts: 2, backoff: 0.1s}\n",
                ),
                profile(
                    "idle",
                    '--steps, "100000", --interval, "0.05"',
                    "    stall: {gpu_util_below: 5%, for: 1s, grace: 5s}\n",
                ),
            ]
        )
    )
    monkeypatch.setenv("WORKLOAD_SECRET", SECRET)
    yield env
    stop_supervisors(env.workspace)


def stop_supervisors(workspace: Path) -> None:
    """Teardown: end every supervisor this workspace started (by its recorded pid, checked by cmdline)."""
    for state in workspace.glob("runs/*/supervisor.json"):
        pid = json.loads(state.read_text()).get("pid")
        try:
            if SUPERVISOR_ARGV in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGTERM)
        except (OSError, TypeError):
            pass


def wait_supervisor(env: Env, run: str, states: tuple[str, ...] = ("done", "gave-up"), timeout: float = 90) -> dict:
    """The supervisor.json of the last run of `run`'s chain once it reached one of `states`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = run
        while (env.runs / current / "restarted_as").is_file():
            current = (env.runs / current / "restarted_as").read_text().strip()
        state_file = env.runs / current / "supervisor.json"
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            if state["state"] in states:
                return {**state, "last": current}
        time.sleep(0.1)
    raise AssertionError(f"supervisor of {run} did not reach {states}")


def events(env: Env, run: str) -> list[dict]:
    path = env.runs / run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_two_crashes_then_success_make_a_three_run_lineage(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = sup.cli(
        "deploy", "--detach", "--profile", "flaky", "--name", "fl", "--launcher", "nohup", capsys=capsys
    )
    assert code == 0 and "supervised in the target by pid" in err, err
    # The supervisor runs from the agent's one zipapp: no second program was uploaded for it.
    shipped = sorted(p.name for p in (sup.workspace / ".dflashops").iterdir() if p.suffix in (".py", ".pyz"))
    assert len(shipped) == 1 and shipped[0].startswith("agent-") and shipped[0].endswith(".pyz"), shipped
    final = wait_supervisor(sup, "fl")
    assert final == {**final, "last": "fl-r2", "state": "done", "reason": "finished", "restarts": 2}
    code, out, err = sup.cli("status", "--json", capsys=capsys)  # the controller learns the children here
    states = {r["name"]: r["state"] for r in json.loads(out)["runs"]}
    assert states == {"fl": "crashed", "fl-r1": "crashed", "fl-r2": "finished"}
    code, out, _ = sup.cli("runs", "show", "fl-r1", "--json", capsys=capsys)
    child = json.loads(out)
    assert child["parent"] == "fl" and child["state"] == "crashed"
    assert child["note"] == "auto-restart after exit 1 at step 12: RuntimeError: injected crash at step 12"
    assert child["extra"]["resumed_from"].endswith("fl/checkpoints/step_000010")
    second = json.loads(sup.cli("runs", "show", "fl-r2", "--json", capsys=capsys)[1])
    assert second["parent"] == "fl-r1" and second["extra"]["resumed_from"].endswith("fl/checkpoints/step_000010")
    assert "resumed from" in (sup.runs / "fl-r2" / "train.log").read_text()
    assert "secret present: True" in (sup.runs / "fl-r2" / "train.log").read_text()  # pass_env reached the child
    assert SECRET.encode() not in all_bytes(sup.workspace) and SECRET.encode() not in all_bytes(sup.root)
    assert [e["event"] for e in events(sup, "fl")] == ["crashed"]
    assert [e["event"] for e in events(sup, "fl-r1")] == ["auto-restarted", "crashed"]
    assert [e["event"] for e in events(sup, "fl-r2")] == ["auto-restarted", "finished"]
    code, out, _ = sup.cli("runs", "tree", capsys=capsys)
    assert out.index("fl") < out.index("fl-r1") < out.index("fl-r2")


def test_always_crashing_stops_after_max_restarts(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        sup.cli("deploy", "--detach", "--profile", "broken", "--name", "br", "--launcher", "nohup", capsys=capsys)[0]
        == 0
    )
    final = wait_supervisor(sup, "br")
    assert final["state"] == "gave-up" and final["last"] == "br-r2" and final["reason"] == "max_restarts 2 reached"
    assert sorted(p.name for p in sup.runs.iterdir()) == ["br", "br-r1", "br-r2"]
    gave_up = events(sup, "br-r2")[-1]
    assert gave_up["event"] == "gave-up" and "max_restarts 2 reached" in gave_up["message"]
    code, out, _ = sup.cli("runs", "sync", "local", "--json", capsys=capsys)  # runs sync learns them too
    assert code == 0 and {o["name"]: o["outcome"] for o in json.loads(out)}["br-r2"] == "added"


def test_a_hung_run_is_stopped_within_the_window(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        sup.cli("deploy", "--detach", "--profile", "hung", "--name", "hg", "--launcher", "nohup", capsys=capsys)[0] == 0
    )
    final = wait_supervisor(sup, "hg", timeout=60)
    assert final["state"] == "gave-up" and final["last"] == "hg"
    stall = json.loads((sup.runs / "hg" / "stall.json").read_text())
    last_beat = stall["last_heartbeat"]  # what status.json said before the stall (it is rewritten on SIGTERM)
    assert "no status.json heartbeat" in stall["reason"]
    assert 1.5 <= stall["at"] - last_beat <= 1.5 + 1.5 / 4 + 1.0  # the window + one poll + slack
    code, out, _ = sup.cli("status", "hg", "--json", capsys=capsys)
    entry = json.loads(out)["runs"][0]
    assert entry["state"] == "crashed" and entry["error_line"].startswith("stalled: no status.json heartbeat")
    assert entry["exit_code"] == 143  # it took the SIGTERM (checkpointed and exited)
    assert [e["event"] for e in events(sup, "hg")] == ["stalled", "gave-up"]


@pytest.mark.parametrize("how", [["stop", "sl"], ["stop", "--all"]])
def test_stop_cancels_a_pending_restart(sup: Env, capsys: pytest.CaptureFixture[str], how: list[str]) -> None:
    assert (
        sup.cli("deploy", "--detach", "--profile", "slow", "--name", "sl", "--launcher", "nohup", capsys=capsys)[0] == 0
    )
    state = wait_supervisor(sup, "sl", states=("backoff",))
    code, out, err = sup.cli(*how, capsys=capsys)
    assert code == 0, err
    if how[1] == "sl":
        assert out.startswith("sl restart-cancelled") and "no automatic restart will follow" in err
    deadline = time.monotonic() + 5
    while Path(f"/proc/{state['pid']}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{state['pid']}").exists()
    assert json.loads((sup.runs / "sl" / "supervisor.json").read_text())["state"] == "cancelled"
    assert sorted(p.name for p in sup.runs.iterdir()) == ["sl"]


def test_steps_that_stop_while_the_heartbeat_beats_are_a_stall(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """The trainer's heartbeat thread beats even when its loop hangs: missing steps must show it."""
    assert (
        sup.cli("deploy", "--detach", "--profile", "stuck", "--name", "st", "--launcher", "nohup", capsys=capsys)[0]
        == 0
    )
    final = wait_supervisor(sup, "st", timeout=60)
    stall = json.loads((sup.runs / "st" / "stall.json").read_text())
    assert final["state"] == "done" and final["reason"] == "no on_failure policy"
    assert stall["reason"].startswith("no new step for") and "at step 5" in stall["reason"]
    assert 1.5 <= stall["at"] - stall["last_step_at"] <= 1.5 + 1.5 / 4 + 1.0
    assert stall["at"] - stall["last_heartbeat"] < 1.0  # the heartbeat was fresh all along


def test_idle_gpus_while_training_are_a_stall(
    sup: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This machine has no GPU: a fake `nvidia-smi` on PATH (a stand-in for hardware that cannot exist
    here) reports two GPUs at 0-1% while the workload says it is training."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncase \"$*\" in *utilization.gpu*) printf '0, 1\\n1, 0\\n';; esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")  # the local supervisor inherits it
    assert (
        sup.cli("deploy", "--detach", "--profile", "idle", "--name", "gi", "--launcher", "nohup", capsys=capsys)[0] == 0
    )
    wait_supervisor(sup, "gi", timeout=60)
    stall = json.loads((sup.runs / "gi" / "stall.json").read_text())
    assert stall["reason"].startswith("GPUs [1, 0]% busy (below 5%) for") and "while training" in stall["reason"]
    code, out, _ = sup.cli("status", "gi", "--json", capsys=capsys)
    assert json.loads(out)["runs"][0]["state"] == "crashed"


def test_dry_run_shows_the_supervisor_start_without_secrets(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = sup.cli("deploy", "--profile", "flaky", "--name", "dr", "--dry-run", capsys=capsys)
    assert code == 0, err
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "start --json-stdin" in line)
    # the command's line and its request JSON (one key a line), up to the plan's next command
    end = next((i for i in range(first + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    start = "\n".join(lines[first:end])
    assert "/.dflashops/agent-" in start and ".pyz supervise start" in start and '"max_restarts": 3' in start
    assert '"WORKLOAD_SECRET": "<redacted>"' in start and SECRET not in out + err
    assert not sup.workspace.exists()


def test_status_says_what_the_supervisor_did(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        sup.cli("deploy", "--detach", "--profile", "broken", "--name", "bs", "--launcher", "nohup", capsys=capsys)[0]
        == 0
    )
    wait_supervisor(sup, "bs")
    code, out, _ = sup.cli("status", capsys=capsys)
    assert re.search(r"^bs\s+local\s+crashed -> auto-restarted as bs-r1\s+7\s", out, re.M), out
    assert "bs error: RuntimeError: injected crash at step 7" in out.splitlines()
    assert re.search(r"^bs-r2\s+local\s+crashed\s+7\s", out, re.M), out  # the last one: not restarted


def test_a_dead_supervisor_is_seen_said_and_started_again_by_the_next_status(
    sup: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """The supervisor is killed; then the run crashes. The next `status` says the supervisor had died, starts a
    new one with the same root and restart count, and that one handles the crash that happened meanwhile as if
    it had been watching: the run is restarted as sv-r1."""
    code, _, err = sup.cli(
        "deploy", "--detach", "--profile", "gated", "--name", "sv", "--launcher", "nohup", capsys=capsys
    )
    assert code == 0, err
    dead = wait_supervisor(sup, "sv", states=("watching",))["pid"]
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{dead}").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (sup.root / "crash-now").touch()
    deadline = time.monotonic() + 60
    while sup.agent("status", {"workspace": str(sup.workspace), "name": "sv"})["runs"][0]["state"] != "crashed":
        assert time.monotonic() < deadline, "the run did not crash"
        time.sleep(0.05)
    assert not (sup.runs / "sv" / "restarted_as").exists()  # nobody watched it
    entry = sup.agent("status", {"workspace": str(sup.workspace), "name": "sv"})["runs"][0]
    assert entry["supervisor"]["state"] == "watching" and entry["supervisor"]["alive"] is False

    code, out, err = sup.cli("status", "sv", capsys=capsys)
    assert code == 0, err
    assert f"sv's supervisor (pid {dead}) had died; started a new one (pid " in err
    assert "(supervisor died, restarted (pid " in out
    deadline = time.monotonic() + 90
    while not (sup.runs / "sv" / "restarted_as").is_file():
        assert time.monotonic() < deadline, "the crash that happened meanwhile was not handled"
        time.sleep(0.1)
    assert (sup.runs / "sv" / "restarted_as").read_text().strip() == "sv-r1"
    child = wait_supervisor(sup, "sv", states=("watching",))
    assert child["last"] == "sv-r1" and child["restarts"] == 1 and child["root"] == "sv"
    assert [e["event"] for e in events(sup, "sv")] == ["crashed"]
    code, out, err = sup.cli("status", "sv", capsys=capsys)  # said once: the new supervisor is alive (or done)
    assert "had died" not in err and "supervisor died" not in out


def test_watch_shows_a_dead_supervisor_and_leaves_it_to_status(sup: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`watch` only reads: it shows that the supervisor died and starts none (no new pid, no supervisor.json
    change); the next `status` starts it again and says so on stderr, once."""
    code, _, err = sup.cli(
        "deploy", "--detach", "--profile", "gated", "--name", "wd", "--launcher", "nohup", capsys=capsys
    )
    assert code == 0, err
    dead = wait_supervisor(sup, "wd", states=("watching",))["pid"]
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{dead}").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    state_file = sup.runs / "wd" / "supervisor.json"
    before = state_file.read_bytes()

    code, out, err = sup.cli("watch", "wd", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["runs"][0]["supervision"] == "supervisor died; `dflashops status` restarts it"
    assert "had died" not in err
    code, out, err = sup.cli("watch", "wd", "--once", capsys=capsys)
    assert code == 0 and "supervisor died; `dflashops status` restarts it" in out, err
    time.sleep(0.5)  # a supervisor started by mistake would have rewritten its state file by now
    assert state_file.read_bytes() == before and json.loads(before)["pid"] == dead

    code, out, err = sup.cli("status", "wd", capsys=capsys)
    assert code == 0, err
    assert f"wd's supervisor (pid {dead}) had died; started a new one (pid " in err
    assert "(supervisor died, restarted (pid " in out
    code, out, err = sup.cli("status", "wd", capsys=capsys)
    assert "had died" not in err and "supervisor died" not in out


def test_a_supervisor_of_the_file_era_is_still_known_after_an_upgrade(tmp_path: Path) -> None:
    """A supervisor started by an older controller ran as its own file (`.dflashops/supervisor-<sha12>.py`): the
    agent still knows it as one, so a stop after the upgrade cancels it; any other process is not one."""
    from dflashops.agent.status import supervisor_alive

    old = tmp_path / ".dflashops" / "supervisor-0123456789ab.py"
    old.parent.mkdir()
    sleeper = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    old.write_text(sleeper)
    other = tmp_path / "other.py"
    other.write_text(sleeper)
    procs = [subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE) for path in (old, other)]
    try:
        # Read only once each runs its own code: Popen returns before the kernel has set the new command line
        # (an immediate /proc/PID/cmdline read is often empty), which would read as "not a supervisor".
        assert [proc.stdout.readline() for proc in procs if proc.stdout] == [b"ready\n"] * 2
        assert supervisor_alive(procs[0].pid) and not supervisor_alive(procs[1].pid)
    finally:
        for proc in procs:  # our own children, by pid
            proc.kill()
            proc.wait()
    assert not supervisor_alive(procs[0].pid)
