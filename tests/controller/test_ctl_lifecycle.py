"""End to end on the local target: deploy -> restart --name + -> stop with a decoy python3 alongside,
setsid children, crashes, waits, timeouts, nohup, SIGKILL escalation, resume. Real tmux, real processes."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import time

import pytest

from tests.controller.helpers import Env


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_deploy_restart_stop_cycle(env: Env, decoy: subprocess.Popen) -> None:
    first = env.run_cli(
        "deploy",
        "local",
        "--profile",
        "work",
        "--name",
        "exp-flex5",
        "--note",
        "baseline",
        "--wait",
        r"step 3\b",
        "--timeout",
        "30",
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "exp-flex5"
    second = env.run_cli(
        "restart",
        "exp-flex5",
        "--name",
        "+",
        "--note",
        "bigger lr",
        "--grace",
        "5",
        "--wait",
        r"step 2\b",
        "--timeout",
        "30",
        "--",
        "--steps",
        "5000",
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "exp-flex6"
    assert "exp-flex5 stopped (exit code 143)" in second.stderr
    stop = env.run_cli("stop", "exp-flex6", "--grace", "5")
    assert stop.returncode == 0, stop.stderr
    assert "exit_code=143" in stop.stdout
    assert sorted(p.name for p in env.runs.iterdir()) == ["exp-flex5", "exp-flex6"]
    for name in ("exp-flex5", "exp-flex6"):
        assert (env.runs / name / "exit_code").read_text().strip() == "143"  # the workload's SIGTERM code
        assert (env.runs / name / "checkpoints").is_dir()
    child = json.loads((env.runs / "exp-flex6" / "run.json").read_text())
    assert child["parent"] == "exp-flex5" and child["note"] == "bigger lr" and "--steps" in child["argv"]
    with sqlite3.connect(env.db) as db:
        rows = dict(db.execute("SELECT name, parent FROM runs").fetchall())
        states = dict(db.execute("SELECT name, state || ':' || exit_code FROM runs").fetchall())
    assert rows == {"exp-flex5": None, "exp-flex6": "exp-flex5"}
    assert states == {"exp-flex5": "stopped:143", "exp-flex6": "stopped:143"}
    assert decoy.poll() is None, "the decoy python3 outside the run was killed"
    status = env.run_cli("status", "--json")
    assert [r["state"] for r in json.loads(status.stdout)["runs"]] == ["stopped", "stopped"]


def test_setsid_child_dies_on_stop(env: Env, capsys: pytest.CaptureFixture[str], decoy: subprocess.Popen) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "tree", "--wait", "step 2", "--", "--spawn-setsid", capsys=capsys
    )
    assert code == 0, err
    child_pid = int((env.runs / "tree" / "child.pid").read_text())
    assert pid_alive(child_pid)
    assert os.getsid(child_pid) != os.getsid(int((env.runs / "tree" / "pgid").read_text()))  # really escaped
    code, out, err = env.cli("stop", "tree", "--grace", "5", capsys=capsys)
    assert code == 0, err
    deadline = time.monotonic() + 5
    while pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child_pid), "a setsid child of the run survived stop"
    assert decoy.poll() is None


def test_crash_is_reported_with_step_and_error(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "crashy",
        "--launcher",
        "nohup",
        "--wait",
        "never-printed",
        "--timeout",
        "30",
        "--",
        "--crash-at",
        "4",
        capsys=capsys,
    )
    assert code == 7, err  # RunFailed: the Traceback pattern appeared
    assert "Traceback" in err
    deadline = time.monotonic() + 10
    while not (env.runs / "crashy" / "exit_code").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    code, out, _ = env.cli("status", "crashy", capsys=capsys)
    assert code == 0
    assert re.search(r"^crashy\s+local\s+crashed\s+4\s.*\s1\s*$", out, re.M), out  # state, step, ..., exit code
    assert "crashy error: RuntimeError: injected crash at step 4" in out.splitlines()
    code, out, _ = env.cli("runs", "show", "crashy", "--json", capsys=capsys)
    assert json.loads(out)["state"] == "crashed"


def test_wait_without_failure_pattern_reports_the_end(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "short",
        "--launcher",
        "nohup",
        "--wait",
        "never-printed",
        "--fail-on",
        "",
        "--",
        "--steps",
        "3",
        capsys=capsys,
    )
    assert code == 7
    assert "short ended (finished at step 3, exit code 0)" in err


def test_wait_timeout_exit_code(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "slow", "--wait", "never-printed", "--timeout", "1", capsys=capsys
    )
    assert code == 8 and "no match within 1s" in err


def test_stop_escalates_to_sigkill(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "stubborn",
        "--launcher",
        "nohup",
        "--wait",
        "step 1",
        "--",
        "--ignore-term",
        capsys=capsys,
    )
    assert code == 0, err
    code, out, err = env.cli("stop", "stubborn", "--grace", "0.5", capsys=capsys)
    assert code == 0, err
    assert "SIGKILL" in err
    assert (env.runs / "stubborn" / "exit_code").read_text().strip() == "137"


def test_the_grace_is_counted_once(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """A job that ignores SIGTERM: SIGKILL comes `--grace` after the SIGTERM, not a second grace later for the
    rest of its group (the fault tester's `stop --grace 3` took 6.1 s)."""
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "deaf", "--launcher", "nohup", "--wait", "step 1", "--",
        "--ignore-term", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    answer = env.agent("stop", {"workspace": str(env.workspace), "name": "deaf", "grace": 4})
    assert answer["ok"] and answer["escalated"], answer
    assert 4 <= answer["seconds"] < 7, answer  # twice the grace (8 s and more) before the fix


def test_stop_waits_past_the_grace_for_a_checkpoint_being_written(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "saver",
        "--launcher",
        "nohup",
        "--wait",
        "step 1",
        "--",
        "--slow-save",
        "2.5",
        capsys=capsys,
    )
    assert code == 0, err
    code, out, err = env.cli("stop", "saver", "--grace", "0.5", capsys=capsys)
    assert code == 0, err
    assert "by SIGTERM" in err and "past the grace period for its checkpoint" in err
    assert (env.runs / "saver" / "exit_code").read_text().strip() == "143"  # the workload's own exit: it finished
    assert list((env.runs / "saver" / "checkpoints").iterdir())
    assert json.loads((env.runs / "saver" / "stop.json").read_text())["waited_for_checkpoint_s"] >= 1.0


def test_a_checkpoint_that_outlasts_the_save_grace_is_killed(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "forever",
        "--launcher",
        "nohup",
        "--wait",
        "step 1",
        "--",
        "--slow-save",
        "60",
        capsys=capsys,
    )
    assert code == 0, err
    started = time.monotonic()
    code, out, err = env.cli("stop", "forever", "--grace", "0.5", "--save-grace", "1", capsys=capsys)
    assert code == 0, err
    assert "SIGKILL" in err and "--save-grace ran out" in err and time.monotonic() - started < 30
    assert (env.runs / "forever" / "exit_code").read_text().strip() == "137"


def test_restart_resume_starts_from_latest_checkpoint(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.cli("deploy", "--profile", "work", "--name", "res-v1", "--wait", "step 3", capsys=capsys)[0] == 0
    code, out, err = env.cli("restart", "res-v1", "--resume", "--grace", "5", "--wait", "resumed from", capsys=capsys)
    assert code == 0, err
    assert out.strip() == "res-v2"
    checkpoint = sorted((env.runs / "res-v1" / "checkpoints").iterdir())[-1]
    assert f"resumed from {checkpoint}" in err
    code, _, err = env.cli("stop", "res-v2", "--grace", "5", capsys=capsys)
    assert code == 0


def test_logs_since_offset_and_until(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        env.cli(
            "deploy",
            "--profile",
            "work",
            "--name",
            "logme",
            "--launcher",
            "nohup",
            "--wait",
            "done",
            "--",
            "--steps",
            "6",
            capsys=capsys,
        )[0]
        == 0
    )
    code, full, _ = env.cli("logs", "logme", "--raw", capsys=capsys)
    assert code == 0 and full.endswith("done\n")
    half = len(full.encode()) // 2
    code, tail, _ = env.cli("logs", "logme", "--since", str(half), "--raw", capsys=capsys)
    data = full.encode()
    start = half if data[half - 1 : half] == b"\n" else data.index(b"\n", half) + 1  # --since lands on a line start
    assert data[start:].decode() == tail and tail.startswith("step ")
    code, out, _ = env.cli("logs", "logme", "--until", r"step 4\b", capsys=capsys)
    assert code == 0 and "step 4" in out and "step 5" not in out


def test_dry_runs_print_commands_and_change_nothing(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.cli("deploy", "--profile", "work", "--name", "dry-v1", "--wait", "step 1", capsys=capsys)[0] == 0
    before = sorted(p.name for p in env.runs.iterdir())
    code, out, err = env.cli("restart", "dry-v1", "--dry-run", capsys=capsys)
    assert code == 0, err
    # One combined agent call (stop + install + launch): the plan is that one command and its stdin.
    assert [line for line in out.splitlines() if line.startswith("[")] == [out.splitlines()[0]]
    assert " restart  < request JSON: " in out and '"old": "dry-v1"' in out
    assert '"name": "dry-v2"' in out and '"grace": 60.0' in out and "+ tar of " in out
    code, out, _ = env.cli("stop", "dry-v1", "--dry-run", capsys=capsys)
    assert code == 0 and out.count("\n") == 1 and " stop --json-args " in out
    assert sorted(p.name for p in env.runs.iterdir()) == before
    code, out, _ = env.cli("status", "dry-v1", capsys=capsys)
    assert re.search(r"^dry-v1\s+local\s+running\s", out, re.M), out
    code, out, _ = env.cli("runs", "list", "--json", capsys=capsys)
    assert "dry-v2" not in out


def test_a_run_stopped_by_a_signal_from_elsewhere_is_stopped_not_crashed(env: Env) -> None:
    """The trainer checkpoints on SIGTERM from anyone (an OOM killer's warning, a user's kill) and records
    phase "stopped": status says stopped with its exit code, not "crashed"."""
    started = env.run_cli(
        "deploy", "local", "--profile", "work", "--name", "external", "--wait", r"step 2\b", "--timeout", "30"
    )
    assert started.returncode == 0, started.stderr
    pgid = int((env.runs / "external" / "pgid").read_text())
    os.killpg(pgid, 15)  # the run's own process group, started by this test's deploy
    deadline = time.monotonic() + 30
    while not (env.runs / "external" / "exit_code").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    runs = json.loads(env.run_cli("status", "external", "--json").stdout)["runs"]
    assert [(r["state"], r["exit_code"]) for r in runs] == [("stopped", 143)]
    assert not (env.runs / "external" / "stop.json").exists()  # dflashops did not stop it


def test_a_reused_pgid_is_never_signalled(env: Env) -> None:
    """A run whose wrapper was lost leaves its pgid on disk; if an unrelated process group later gets that
    number, neither `status` nor `stop` may treat that group as the run's."""
    started = env.run_cli(
        "deploy",
        "local",
        "--profile",
        "work",
        "--name",
        "lost",
        "--launcher",
        "nohup",
        "--wait",
        r"step 2\b",
        "--timeout",
        "30",
    )
    assert started.returncode == 0, started.stderr
    assert env.run_cli("stop", "lost", "--grace", "5").returncode == 0
    (env.runs / "lost" / "exit_code").unlink()  # as if the wrapper had been SIGKILLed before recording it
    (env.runs / "lost" / "stop.json").unlink()
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)  # an unrelated group, ours to end
    try:
        (env.runs / "lost" / "pgid").write_text(f"{stranger.pid}\n")  # the number was reused
        runs = json.loads(env.run_cli("status", "lost", "--json").stdout)["runs"]
        assert runs[0]["state"] == "lost" and runs[0]["pids"] == []
        refused = env.run_cli("stop", "lost", "--grace", "1")
        assert refused.returncode == 9 and "not running" in refused.stderr
        assert stranger.poll() is None, "stop signalled a process group that is no longer the run's"
    finally:
        stranger.kill()
        stranger.wait()
