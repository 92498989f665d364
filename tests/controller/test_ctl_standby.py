"""Standby interpreters (dflashops/agent/standby.py): a `python -m trainer` launch with `standby: true` leaves an
interpreter with its imports done, waiting; the next launch like it adopts it. Real agent, real processes,
real tmux: the `trainer` here is a small package in a release folder that prints what it was started with, and
the standbys import `json` ahead instead of torch (the real trainer's adoption: tests/trainer/test_bench.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dflashops.agent.common import run_processes, tmux_socket
from dflashops.agent.standby import standbys
from tests.controller.helpers import Env, all_bytes

FAKE_TRAINER = """\
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "run": os.environ.get("DFLASHOPS_RUN"),
                  "secret": os.environ.get("RUN_TOKEN"), "code": CODE, "path0": sys.path[0],
                  "standby_only": os.environ.get("STANDBY_ONLY")}), flush=True)
if "--sleep" in sys.argv:
    time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def release(root: Path, name: str, code: str) -> Path:
    package = root / name / "trainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(f"CODE = {code!r}\n" + FAKE_TRAINER)
    return root / name


def launch(
    env: Env, name: str, rel: Path, *args: str, launcher: str = "nohup", job_env: dict | None = None, **extra: object
) -> dict:
    request = {
        "workspace": str(env.workspace),
        "name": name,
        "argv": [sys.executable, "-m", "trainer", "train", *args],
        "env": {
            "PYTHONPATH": str(rel),
            "TORCHINDUCTOR_CACHE_DIR": str(env.workspace / "cache" / "inductor" / rel.name),  # per code, as deploy
            "RUN_TOKEN": "s3cret-token",
            "PLAIN_NAMED": "s3cret-plain",  # a pass_env secret whose name looks like nothing
            **(job_env or {}),
        },
        "secret_keys": ["PLAIN_NAMED", "RUN_TOKEN"],
        "launcher": launcher,
        "standby": True,
        "standby_preload": ["json"],
        **extra,
    }
    answer = env.agent("launch", request)
    assert answer["ok"], answer
    return answer


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ready_standby(env: Env) -> tuple[Path, int]:
    """The one ready standby of the workspace: (its folder, its interpreter's pid)."""
    found: list[tuple[Path, int]] = []

    def one_ready() -> bool:
        found[:] = [
            (Path(folder), int((Path(folder) / "ready").read_text()))
            for folder, _ in standbys(str(env.workspace))
            if (Path(folder) / "ready").exists()
        ]
        return len(found) == 1

    wait_for(one_ready, "a ready standby")
    return found[0]


def finished(env: Env, name: str) -> dict:
    wait_for(lambda: (env.runs / name / "exit_code").exists(), f"{name} to end")
    lines = (env.runs / name / "train.log").read_text().splitlines()
    return {"exit_code": int((env.runs / name / "exit_code").read_text()), **json.loads(lines[-1])}


def test_the_next_launch_takes_the_standby_with_its_own_argv_env_cwd_and_exit_code(env: Env) -> None:
    rel = release(env.root, "rel1", "v1")
    first = launch(env, "sb1", rel)
    assert first["standby"] is False  # nothing was waiting yet
    assert finished(env, "sb1")["exit_code"] == 0
    folder, standby_pid = ready_standby(env)  # it followed sb1, which has ended: imports done

    second = launch(env, "sb2", rel, "--lr", "3e-4", job_env={"EXIT_WITH": "3"})
    assert second["standby"] is True
    assert env.job_pid("sb2") == standby_pid
    assert (env.runs / "sb2" / "marker").read_text().strip() == second["marker"]
    run = finished(env, "sb2")
    assert run["exit_code"] == 3
    assert run["pid"] == standby_pid
    assert run["argv"] == ["train", "--lr", "3e-4"]
    assert run["cwd"] == str(env.runs / "sb2")
    assert run["run"] == "sb2"
    assert run["secret"] == "s3cret-token"  # the run's secrets reach it, at adoption only
    assert run["path0"] == str(env.runs / "sb2")  # `-m`'s sys.path: the working directory first
    wait_for(lambda: not folder.exists(), "the adopted standby's folder to go")
    ready_standby(env)  # the next one is started, following sb2
    assert b"s3cret" not in all_bytes(env.workspace / "standby")
    spare = next(iter(standbys(str(env.workspace))))[1]
    assert "PLAIN_NAMED" not in spare["env"] and "RUN_TOKEN" not in spare["env"]


def test_a_first_launch_with_a_preflight_pays_the_imports_once(env: Env) -> None:
    """A fresh workspace has no standby: the launch starts one first, checks in a fork of it once it is ready,
    and the run adopts it, instead of a new interpreter for the check and another for the run (issue 28's
    fresh-workspace start)."""
    rel = release(env.root, "rel1", "v1")
    first = launch(env, "pf1", rel, preflight=True, run_json={"release": str(rel)})
    assert first["preflight"]["in"] == "a standby interpreter", first["preflight"]
    assert first["standby"] is True  # the run is the interpreter that checked its flags' parent
    run = finished(env, "pf1")
    assert run["exit_code"] == 0 and run["argv"] == ["train"] and run["secret"] == "s3cret-token"
    ready_standby(env)  # and one more waits for the next launch


def test_a_code_change_reaches_the_adopted_run(env: Env) -> None:
    launch(env, "sc1", release(env.root, "rel1", "old code"))
    finished(env, "sc1")
    ready_standby(env)
    second = launch(env, "sc2", release(env.root, "rel2", "new code"))
    assert second["standby"] is True
    run = finished(env, "sc2")
    assert run["code"] == "new code"  # the standby imported nothing from the release ahead


def test_stop_ends_an_adopted_run_like_any_other(env: Env) -> None:
    rel = release(env.root, "rel1", "v1")
    launch(env, "ss1", rel)
    finished(env, "ss1")
    ready_standby(env)
    answer = launch(env, "ss2", rel, "--sleep", "60")
    assert answer["standby"] is True
    wait_for(lambda: (env.runs / "ss2" / "train.log").exists(), "ss2's first line")
    stopped = env.agent("stop", {"workspace": str(env.workspace), "name": "ss2", "grace": 5})
    assert stopped["ok"] and stopped["exit_code"] == 143, stopped
    marker = (env.runs / "ss2" / "marker").read_text().strip()
    assert run_processes(answer["pgid"], marker, str(env.runs / "ss2"))[1] == set()
    status = env.agent("status", {"workspace": str(env.workspace), "name": "ss2"})
    assert status["runs"][0]["state"] == "stopped"


def test_another_startup_environment_is_launched_fresh_and_retires_the_standby(env: Env) -> None:
    rel = release(env.root, "rel1", "v1")
    launch(env, "se1", rel)
    finished(env, "se1")
    old_folder, old_pid = ready_standby(env)
    answer = launch(env, "se2", rel, job_env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})  # read by torch at import
    assert answer["standby"] is False
    assert finished(env, "se2")["pid"] != old_pid
    wait_for(lambda: not old_folder.exists(), "the retired standby to exit")
    folder, _ = ready_standby(env)  # one for the new environment
    assert json.loads((folder / "spec.json").read_text())["env"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"


def test_an_unused_standby_exits_after_its_idle_time(env: Env) -> None:
    launch(env, "si1", release(env.root, "rel1", "v1"), standby_idle_s=1)
    finished(env, "si1")
    wait_for(lambda: standbys(str(env.workspace)) == [], "the idle standby to exit", timeout=15)


def test_standby_false_retires_every_standby(env: Env) -> None:
    rel = release(env.root, "rel1", "v1")
    launch(env, "sf1", rel)
    finished(env, "sf1")
    ready_standby(env)
    answer = launch(env, "sf2", rel, standby=False)
    assert answer["standby"] is False
    wait_for(lambda: standbys(str(env.workspace)) == [], "the standbys to exit")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_adoption_gives_the_run_its_session(env: Env) -> None:
    rel = release(env.root, "rel1", "v1")
    launch(env, "st1", rel, launcher="tmux")
    finished(env, "st1")
    ready_standby(env)
    answer = launch(env, "st2", rel, "--sleep", "60", launcher="tmux")
    assert answer["standby"] is True and answer["session"] == "st2"
    socket = tmux_socket(str(env.workspace))
    sessions = subprocess.run(["tmux", "-L", socket, "ls", "-F", "#S"], capture_output=True, text=True).stdout.split()
    assert "st2" in sessions
    stopped = env.agent("stop", {"workspace": str(env.workspace), "name": "st2", "grace": 5})
    assert stopped["exit_code"] == 143
    sessions = subprocess.run(["tmux", "-L", socket, "ls", "-F", "#S"], capture_output=True, text=True).stdout.split()
    assert "st2" not in sessions


def test_a_job_that_is_not_the_trainer_never_gets_a_standby(env: Env) -> None:
    request = {
        "workspace": str(env.workspace),
        "name": "plain",
        "argv": [sys.executable, "-c", "print('hi')"],
        "env": {},
        "launcher": "nohup",
        "standby": True,
    }
    assert env.agent("launch", request)["standby"] is False
    time.sleep(0.5)
    assert standbys(str(env.workspace)) == []


def test_gc_standby_retires_the_waiting_interpreters(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    rel = release(env.root, "rel1", "v1")
    launch(env, "sg1", rel)
    finished(env, "sg1")
    folder, _ = ready_standby(env)
    code, out, err = env.cli("gc", "--standby", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["retired_standbys"] == [folder.name]
    wait_for(lambda: standbys(str(env.workspace)) == [], "the standby to exit")


def test_doctor_tells_what_waits(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = env.cli("doctor", "--json", capsys=capsys)
    checks = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}
    assert checks["standby"]["status"] == "skip"  # the inventory's target has no `standby: true`
    launch(env, "sd1", release(env.root, "rel1", "v1"))
    finished(env, "sd1")
    _, pid = ready_standby(env)
    code, out, _ = env.cli("doctor", "--json", capsys=capsys)
    check = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}["standby"]
    assert check["status"] == "warn" and f"pid {pid}" in check["detail"] and "--standby" in check["hint"]
    env.inventory.write_text(
        env.inventory.read_text().replace("    workspace: ws\n", "    workspace: ws\n    standby: true\n")
    )
    code, out, _ = env.cli("doctor", "--json", capsys=capsys)
    check = {c["name"]: c for c in json.loads(out)["targets"][0]["checks"]}["standby"]
    assert check["status"] == "ok" and f"pid {pid}" in check["detail"]


def environ_of(pid: int) -> list[bytes]:
    """The environment a process started with (/proc/PID/environ keeps it for the process's whole life)."""
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_a_standby_starts_with_no_secret_and_hands_none_to_the_run_that_takes_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first deploy's shell holds DB_PASS (its profile's pass_env) and the launch names its run in WANDB_NAME;
    the standby started after it must hold neither (its interpreter and its wrapper), and a later run deployed
    from a shell without DB_PASS, which adopts that standby, must not carry it."""
    rel = release(env.root, "rel1", "v1")
    monkeypatch.setenv("DB_PASS", "db-s3cret-pass")  # in the agent's own environment, as on a local target
    launch(env, "sx1", rel, job_env={"DB_PASS": "db-s3cret-pass", "WANDB_NAME": "sx1"},
           secret_keys=["DB_PASS", "PLAIN_NAMED", "RUN_TOKEN"])  # fmt: skip
    finished(env, "sx1")
    folder, standby_pid = ready_standby(env)
    wrapper_pid = int((folder / "pgid").read_text())
    for pid in (standby_pid, wrapper_pid):
        environ = environ_of(pid)
        assert not [v for v in environ if b"s3cret" in v or v.startswith((b"WANDB_NAME=", b"DB_PASS="))], environ
    monkeypatch.delenv("DB_PASS")
    answer = launch(env, "sx2", rel, "--sleep", "60", job_env={"RUN_TOKEN": "sx2-token"})
    assert answer["standby"] is True
    job = env.job_pid("sx2")
    assert job == standby_pid
    assert not [v for v in environ_of(job) if v.startswith(b"DB_PASS=") or b"s3cret" in v]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_tmux_run_gets_its_own_environment_not_the_tmux_servers(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace's tmux server is started by the first launch, with that agent's environment (DB_PASS here);
    a later tmux run launched from an environment without it must not inherit it from the server."""

    def run_printing_db_pass(name: str) -> str:
        request = {
            "workspace": str(env.workspace),
            "name": name,
            "argv": [sys.executable, "-c", "import os; print('DB_PASS=' + str(os.environ.get('DB_PASS')))"],
            "env": {},
            "launcher": "tmux",
        }
        assert env.agent("launch", request)["ok"]
        wait_for(lambda: (env.runs / name / "exit_code").exists(), f"{name} to end")
        return (env.runs / name / "train.log").read_text()

    monkeypatch.setenv("DB_PASS", "db-s3cret-pass")
    assert "DB_PASS=db-s3cret-pass" in run_printing_db_pass("tx1")  # the shell it was launched from has it
    monkeypatch.delenv("DB_PASS")
    assert "DB_PASS=None" in run_printing_db_pass("tx2")
