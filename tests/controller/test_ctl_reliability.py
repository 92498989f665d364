"""The reliability defects a fault tester found in process control, names, secrets, arguments and logs
(issue 15, items 3-6 and 8-15). Real processes, real tmux, the real agent and CLI on the local target; each
test is named after its item and failed before the fix."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashops.agent.common import session_name, tmux_socket
from tests.controller.helpers import AGENT, REPO, Env, all_bytes
from tests.tmux_screen import session_names

# A job that writes nothing but its log: prints a line, then waits for SIGTERM (exit 143) or `go` (exit 3).
SLEEPER = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
    "print('sleeping', flush=True)\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
    "sys.exit(3)\n"
)


def add_profile(env: Env, name: str, body: str) -> None:
    """Append a profile to the test inventory (`body`: the YAML lines under the profile name)."""
    text = env.inventory.read_text()
    env.inventory.write_text(text + f"  {name}:\n" + "".join(f"    {line}\n" for line in body.strip().splitlines()))


def wait_until(predicate, timeout: float = 30.0, explain=None) -> None:
    """Poll `predicate` until true; past `timeout` fail, with `explain()` (what the test can show of why)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time" + (f":\n{explain()}" if explain else "")
        time.sleep(0.05)


def state_of(env: Env, name: str) -> dict:
    return env.agent("status", {"workspace": str(env.workspace), "name": name})["runs"][0]


# ------------------------------------------------------------------------------------------- item 3
def test_item3_a_stop_that_races_the_launch_wins(env: Env) -> None:
    """`stop` issued the moment the run directory appears, before the job has started: 16 of 16 times the
    job must end stopped, never start a second later and keep running. The stop runs in this process (the
    agent's own function), so it lands inside the launch's first milliseconds."""
    from dflashops.agent import common, stop
    from dflashops.agent.protocol import parse

    workload = str(env.root / "workload.py")
    for index in range(16):
        name = f"race{index}"
        request = {
            "workspace": str(env.workspace),
            "name": name,
            "launcher": "nohup",
            "argv": [sys.executable, workload, "--output-dir", str(env.runs / name), "--interval", "0.05"],
        }
        launch = subprocess.Popen(
            [sys.executable, str(AGENT), "launch", "--json-args", json.dumps(request)],
            stdout=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 10
        while not (env.runs / name).is_dir():
            assert time.monotonic() < deadline
        try:
            answer = stop.verb_stop(parse("stop", {"workspace": str(env.workspace), "name": name, "grace": 5}))
        except common.AgentFailure as exc:
            answer = {"error": str(exc)}
        launch.communicate(timeout=30)
        assert "error" not in answer, f"round {index}: {answer}"
        wait_until(lambda: state_of(env, name)["pids"] == [], timeout=10)  # noqa: B023 - waited for here
        entry = state_of(env, name)
        assert entry["state"] == "stopped", f"round {index}: {entry['state']}"


# ------------------------------------------------------------------------------------------- item 4
def test_item4_run_names_that_tmux_would_merge_get_their_own_sessions(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    assert session_name("exp.1") != session_name("exp_1") and session_name("exp-flex5") == "exp-flex5"
    for name in ("exp.1", "exp_1"):
        code, _, err = env.cli("deploy", "--profile", "work", "--name", name, "--wait", "step 1", capsys=capsys)
        assert code == 0, err
    sessions = session_names(tmux_socket(str(env.workspace)))
    assert sorted(sessions) == sorted([session_name("exp.1"), session_name("exp_1")])
    assert json.loads((env.runs / "exp.1" / "run.json").read_text())["session"] == session_name("exp.1")
    assert env.cli("stop", "exp_1", "--grace", "5", capsys=capsys)[0] == 0
    assert state_of(env, "exp.1")["state"] == "running", "stopping exp_1 touched exp.1"
    sessions = session_names(tmux_socket(str(env.workspace)))
    assert sessions == [session_name("exp.1")]


# ------------------------------------------------------------------------------------------- item 5
def test_item5_a_failed_launch_leaves_no_secret_file(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKLOAD_SECRET", "hunter2-launch-file")
    # tmux refuses after the launch wrote its spec: its socket folder cannot be made (a file stands there).
    # (A session of the same name is refused before anything is written: test_ctl_tmux_duplicate.py.)
    (env.root / "not-a-folder").write_text("")
    monkeypatch.setenv("TMUX_TMPDIR", str(env.root / "not-a-folder"))
    code, _, err = env.cli("deploy", "--detach", "--profile", "work", "--name", "clash", capsys=capsys)
    assert code != 0 and "tmux new-session failed" in err and "Traceback" not in err
    assert not (env.runs / "clash" / ".launch.json").exists()
    assert b"hunter2-launch-file" not in all_bytes(env.root)
    assert state_of(env, "clash")["state"] == "crashed"
    with sqlite3.connect(env.db) as db:  # the claimed name was released: nothing recorded for a run that never ran
        assert db.execute("SELECT COUNT(*) FROM runs WHERE name = 'clash'").fetchone()[0] == 0


# ------------------------------------------------------------------------------------------- item 6
def test_item6_every_pass_env_value_is_a_secret_whatever_its_name(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env.inventory.write_text(
        env.inventory.read_text().replace(
            "pass_env: [WORKLOAD_SECRET]", "pass_env: [WORKLOAD_SECRET, DB_PASS, OPENAI_KEY]"
        )
    )
    values = {"DB_PASS": "plainpass42", "OPENAI_KEY": "short-key"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    code, out, err = env.cli("deploy", "--profile", "work", "--name", "pe", "--dry-run", capsys=capsys)
    assert code == 0 and "DB_PASS" in out
    shown = out + err
    code, out, err = env.cli("deploy", "--profile", "work", "--name", "pe", "--wait", "step 1", capsys=capsys)
    assert code == 0, err
    job = env.job_pid("pe")
    environ = Path(f"/proc/{job}/environ").read_bytes().split(b"\0")
    assert b"DB_PASS=plainpass42" in environ and b"OPENAI_KEY=short-key" in environ  # the run has them
    for verb in (("status", "pe", "--json"), ("runs", "show", "pe", "--json"), ("runs", "export", "--format", "json")):
        code, out, err = env.cli(*verb, capsys=capsys)
        assert code == 0, err
        shown += out + err
    run_json = json.loads((env.runs / "pe" / "run.json").read_text())
    assert run_json["env"]["DB_PASS"] == "<redacted>" and run_json["env"]["OPENAI_KEY"] == "<redacted>"
    stored = all_bytes(env.root)  # run.json, lineage.sqlite (+ WAL), logs: every file under the test's folder
    for value in values.values():
        assert value not in shown and value.encode() not in stored


# ------------------------------------------------------------------------------------------- item 8
def test_item8_status_shows_the_trainers_own_error_line(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    add_profile(
        env,
        "fails",
        """
argv: ["{python}", "-c", "import sys; print('loading', flush=True); print('error: --target-model is required for preset qwen3-8b', file=sys.stderr); print('hint: pass --target-model PATH', file=sys.stderr); sys.exit(2)"]
packages: []
""",
    )
    code, _, err = env.cli(
        "deploy", "--detach", "--profile", "fails", "--name", "bad", "--launcher", "nohup", capsys=capsys
    )
    assert code == 0, err
    wait_until(lambda: (env.runs / "bad" / "exit_code").exists())
    code, out, _ = env.cli("status", "bad", capsys=capsys)
    assert re.search(r"^bad\s+local\s+crashed\b", out, re.M), out  # the table's row, then its error line
    assert "bad error: --target-model is required for preset qwen3-8b" in out and "None" not in out
    code, out, _ = env.cli("status", "bad", "--json", capsys=capsys)
    assert json.loads(out)["runs"][0]["error_line"] == "error: --target-model is required for preset qwen3-8b"


# ------------------------------------------------------------------------------------------- item 9
def test_item9_logs_follow_of_a_crashed_run_exits_non_zero(env: Env) -> None:
    deployed = env.run_cli(
        "deploy", "--detach", "--profile", "work", "--name", "crash9", "--launcher", "nohup", "--", "--crash-at", "3"
    )
    assert deployed.returncode == 0, deployed.stderr
    follow = env.run_cli("logs", "crash9", "-f", "--timeout", "60")
    assert follow.returncode == 7, follow.stderr
    assert "step 2 loss" in follow.stdout and "Traceback" in follow.stdout
    assert "error: crash9 crashed at step 3" in follow.stderr and "RuntimeError: injected crash" in follow.stderr
    finished = env.run_cli(
        "deploy", "--detach", "--profile", "work", "--name", "fine9", "--launcher", "nohup", "--", "--steps", "2"
    )
    assert finished.returncode == 0 and env.run_cli("logs", "fine9", "-f", "--timeout", "60").returncode == 0


# ------------------------------------------------------------------------------------------ item 10
def test_item10_managed_flags_are_refused_and_others_replace_the_profiles(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "m1", "--", "--output-dir", "/tmp/elsewhere", capsys=capsys
    )
    assert code == 2 and "error: --output-dir is managed by dflashops" in err and "{run_dir}" in err
    assert "hint:" in err and not env.workspace.exists() and not env.db.exists(), "a refused deploy changed something"
    code, _, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "m1", "--", "--steps", "5", "--steps=6", capsys=capsys
    )
    assert code == 2 and "error: --steps is given twice after --" in err
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "m1",
        "--launcher",
        "nohup",
        "--wait",
        "done",
        "--",
        "--interval",
        "0.01",
        "--steps",
        "3",
        capsys=capsys,
    )
    assert code == 0, err
    argv = json.loads((env.runs / "m1" / "run.json").read_text())["argv"]
    assert argv.count("--interval") == 1 and argv[argv.index("--interval") + 1] == "0.01"
    code, _, err = env.cli(
        "restart",
        "m1",
        "--launcher",
        "nohup",
        "--wait",
        "done",
        "--",
        "--interval",
        "0.02",
        "--steps",
        "3",
        capsys=capsys,
    )
    assert code == 0, err
    code, out, _ = env.cli("runs", "diff", "m1", "m2", capsys=capsys)
    assert "--interval" in out and "0.01" in out and "0.02" in out and "[" not in out


# ------------------------------------------------------------------------------------------ item 11
def test_item11_an_install_keeps_temporaries_whose_owner_is_alive(
    env: Env, capsys: pytest.CaptureFixture[str], decoy: subprocess.Popen
) -> None:
    releases = env.workspace / "releases"
    releases.mkdir(parents=True)
    busy = releases / f".tmp-0123456789abcdef-{decoy.pid}"  # another install, still running
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    abandoned = releases / f".tmp-fedcba9876543210-{gone.pid}"  # its installer is gone
    for folder in (busy, abandoned):
        folder.mkdir()
        (folder / "half-written.py").write_text("x")
    code, _, err = env.cli(
        "deploy",
        "--detach",
        "--profile",
        "work",
        "--name",
        "t11",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "1",
        capsys=capsys,
    )
    assert code == 0, err
    assert busy.is_dir() and (busy / "half-written.py").exists(), "an install deleted another one's work"
    assert not abandoned.exists()


def test_item11_concurrent_deploys_of_new_code_all_succeed(env: Env) -> None:
    add_profile(
        env,
        "other",
        """
argv: ["{python}", "{release}/workload.py", --output-dir, "{run_dir}", --steps, "1"]
files: [workload.py, other.txt]
packages: []
""",
    )
    workload = env.root / "workload.py"
    original = workload.read_text()
    for round_ in range(3):
        workload.write_text(original + f"\n# round {round_}\n")
        (env.root / "other.txt").write_text(f"round {round_}\n")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dflashops.cli.main",
                    "--inventory",
                    str(env.inventory),
                    "deploy",
                    "--detach",
                    "--profile",
                    profile,
                    "--name",
                    f"{profile}{round_}",
                    "--launcher",
                    "nohup",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=env.root,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            )
            for profile in ("work", "other")
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"round {round_}: {err}"
    assert not [p for p in (env.workspace / "releases").iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------------------------------ item 12
def test_item12_tail_detects_a_truncated_or_replaced_log(env: Env) -> None:
    run = env.runs / "t12"
    run.mkdir(parents=True)
    log = run / "train.log"
    log.write_text("".join(f"old {i}\n" for i in range(20)))
    request = {"workspace": str(env.workspace), "name": "t12", "offset": 0}
    first = env.agent("tail", request)
    assert first["data"].count("\n") == 20 and first["notice"] is None
    # Truncated in place, then written past the old offset again: a size check alone would miss this.
    log.write_text("".join(f"new line {i}\n" for i in range(30)))
    cursor = {"offset": first["offset"], "inode": first["inode"], "check": first["check"]}
    second = env.agent("tail", {**request, **cursor})
    assert "truncated or rewritten" in second["notice"]
    assert second["data"] == "".join(f"new line {i}\n" for i in range(30))
    # Replaced by a new file renamed over it (no train.log.1 holds the old inode).
    (run / "next.log").write_text("fresh 1\nfresh 2\n")
    os.replace(run / "next.log", log)
    cursor = {"offset": second["offset"], "inode": second["inode"], "check": second["check"]}
    third = env.agent("tail", {**request, **cursor})
    assert "replaced by a new file" in third["notice"] and third["data"] == "fresh 1\nfresh 2\n"
    # Growth without rewriting: no notice.
    with log.open("a") as handle:
        handle.write("fresh 3\n")
    fourth = env.agent("tail", {**request, "offset": third["offset"], "inode": third["inode"], "check": third["check"]})
    assert fourth["notice"] is None and fourth["data"] == "fresh 3\n"


def test_item12_logs_follow_reads_a_truncated_log_again_and_says_so(env: Env) -> None:
    # The run truncates its log only once the follower has shown the first part (the test drops `go` into the
    # run directory then), so the follower is certain to be reading when the log is cut, however slow the
    # machine: a fixed sleep before the cut raced the follower's start under load.
    add_profile(
        env,
        "truncates",
        """
argv: ["{python}", "-c", "import os, time\\nfor i in range(50): print('first %d' % i, flush=True)\\nwhile not os.path.exists('go'): time.sleep(0.05)\\nos.truncate('train.log', 0)\\nfor i in range(80): print('second %d' % i, flush=True)\\ntime.sleep(0.5)"]
packages: []
""",
    )
    assert (
        env.run_cli("deploy", "--detach", "--profile", "truncates", "--name", "tr", "--launcher", "nohup").returncode
        == 0
    )
    follow = subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), "logs", "tr", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=env.root,
    )
    try:
        assert follow.stdout is not None
        shown = []
        while (line := follow.stdout.readline()) and line != "first 49\n":
            shown.append(line)
        assert line == "first 49\n", f"the follower ended before the first part: {shown[-3:]}"
        (env.runs / "tr" / "go").touch()
        rest, err = follow.communicate(timeout=120)
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert "train.log was truncated or rewritten" in err
    second = [line for line in rest.splitlines() if line.startswith("second")]
    assert second == [f"second {i}" for i in range(80)], "lines after the truncation were lost or repeated"


# ------------------------------------------------------------------------------------------ item 13
def test_item13_lines_longer_than_a_read_are_cut_between_characters(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    long_line = "a" + "é€" * 400_000  # 2 MB of UTF-8: two and a bit 1 MiB reads, misaligned by the "a"
    add_profile(
        env,
        "wide",
        """
argv: ["{python}", "-c", "print('a' + 'é€' * 400000, flush=True); print('end', flush=True)"]
packages: []
""",
    )
    assert (
        env.cli(
            "deploy",
            "--profile",
            "wide",
            "--name",
            "wide",
            "--launcher",
            "nohup",
            "--wait",
            "^end",
            "--timeout",
            "60",
            capsys=capsys,
        )[0]
        == 0
    )
    code, out, _ = env.cli("logs", "wide", "--raw", capsys=capsys)
    assert code == 0 and "\ufffd" not in out
    assert out == long_line + "\nend\n"


# ------------------------------------------------------------------------------------------ item 15
def test_item15_concurrent_next_name_deploys_both_succeed(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        env.cli(
            "deploy",
            "--detach",
            "--profile",
            "work",
            "--name",
            "base1",
            "--launcher",
            "nohup",
            "--",
            "--steps",
            "1",
            capsys=capsys,
        )[0]
        == 0
    )
    names: list[str] = []
    for round_ in range(3):
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dflashops.cli.main",
                    "--inventory",
                    str(env.inventory),
                    "deploy",
                    "--detach",
                    "--profile",
                    "work",
                    "--name",
                    "+",
                    "--parent",
                    "base1",
                    "--launcher",
                    "nohup",
                    "--",
                    "--steps",
                    "1",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=env.root,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            )
            for _ in range(2)
        ]
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"round {round_}: {err}"
            names.append(out.strip())
    assert sorted(names) == [f"base{i}" for i in range(2, 8)]
    with sqlite3.connect(env.db) as db:
        parents = dict(db.execute("SELECT name, parent FROM runs").fetchall())
    assert {name: parents[name] for name in names} == {name: "base1" for name in names}


# ------------------------------------------------------------------------------------------- item 2
@pytest.mark.slow
def test_item2_stopping_a_run_with_wandb_leaves_no_traceback(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real trainer with W&B on (offline): the stop must let it checkpoint and close its W&B run before
    the W&B service is signalled, so the log ends cleanly and `logs --fail-on Traceback` passes."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    add_profile(
        env,
        "tinyw",
        """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "on", --log-interval, "1"]
resume_args: [--resume, "{checkpoint}"]
env: {TRAINER_TEST_MIN_STEP_S: "0.1"}
""",
    )
    code, _, err = env.cli(
        "deploy", "--profile", "tinyw", "--name", "w1", "--wait", r"^step 3/", "--timeout", "240", capsys=capsys
    )
    assert code == 0, err
    job = env.job_pid("w1")
    code, out, err = env.cli("stop", "w1", "--grace", "60", capsys=capsys)
    assert code == 0 and "exit_code=143" in out, err
    log = (env.runs / "w1" / "train.log").read_text()
    assert "wandb" in log and "Traceback" not in log and "ConnectionResetError" not in log, log[-3000:]
    assert list((env.runs / "w1" / "checkpoints").glob("step_*")), "no checkpoint after the stop"
    code, _, err = env.cli("logs", "w1", "-f", "--fail-on", "Traceback", capsys=capsys)
    assert code == 0, err  # the README's crash check passes on a clean stop
    assert not list(Path("/tmp").glob(f"wandb_*-{job}-*.sock")), "the W&B service's socket was left behind"
