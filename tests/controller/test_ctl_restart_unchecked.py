"""A restart never stops a live run for a job it cannot check (issue 45 item 1). A job other than the trainer is
checked by its profile's `check:` command (run in the new release with the `--` arguments appended, before the
old run is stopped); with none, restart refuses to stop a running parent unless `--unchecked` is given. Real
processes on the local target: the test workload (tests/workloads/workload.py), whose `--check-only` validates
its arguments with argparse."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflashops.core.errors import InventoryError
from dflashops.core.inventory import load_inventory
from tests.controller.helpers import Env
from tests.controller.test_ctl_reliability import add_profile, wait_until

# The `work` profile without its `check:` (tests/controller/helpers.py): a plain script nothing can check.
PLAIN = """
argv: ["{python}", "{release}/workload.py", --output-dir, "{run_dir}", --interval, "0.05"]
files: [workload.py]
packages: []
resume_args: [--resume-from, "{checkpoint}"]
"""


def deploy_running(env: Env, capsys: pytest.CaptureFixture[str], profile: str, name: str, *extra: str) -> int:
    code, _, err = env.cli(
        "deploy", "--profile", profile, "--name", name, "--launcher", "nohup", "--wait", "step 3", *extra,
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    return env.job_pid(name)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def untouched(env: Env, capsys: pytest.CaptureFixture[str], run: str, pid: int, child: str) -> None:
    """`run` trains on (its job alive, no stop asked), and `child` left no run directory and no lineage row."""
    code, out, _ = env.cli("status", run, "--json", capsys=capsys)
    assert json.loads(out)["runs"][0]["state"] == "running"
    assert alive(pid) and not (env.runs / run / "stop.json").exists()
    assert not (env.runs / child).exists()
    code, out, _ = env.cli("runs", "list", "--json", capsys=capsys)
    assert child not in {row["name"] for row in json.loads(out)}


def test_a_live_run_of_a_job_nothing_can_check_is_not_stopped_unless_told(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    add_profile(env, "plain", PLAIN)
    pid = deploy_running(env, capsys, "plain", "un1")
    code, out, err = env.cli(
        "restart", "--detach", "un1", "--name", "+", "--resume", "--", "--no-such-flag", "3", capsys=capsys
    )
    assert code == 2 and out == "", err
    assert err.strip().splitlines()[-2:] == [
        "error: un1's job (profile plain) cannot be checked before the old run is stopped",
        f"hint: add check: to profile plain in {env.inventory} (a command that exits 0 when the job can start), "
        "or pass --unchecked to stop it anyway",
    ], err
    untouched(env, capsys, "un1", pid, "un2")
    # --dry-run says the same (the new code is on the target: its pre-flight runs), and --unchecked passes it
    code, _, err = env.cli("restart", "un1", "--resume", "--dry-run", capsys=capsys)
    assert code == 2 and "error: un1's job (profile plain) cannot be checked before the old run is stopped" in err
    code, _, err = env.cli("restart", "un1", "--resume", "--dry-run", "--unchecked", capsys=capsys)
    assert code == 0 and "pre-flight: every Python file compiles" in err, err
    untouched(env, capsys, "un1", pid, "un2")

    # --unchecked: today's restart (the old run stopped, the child launched from its checkpoint)
    code, out, err = env.cli("restart", "--detach", "un1", "--resume", "--unchecked", capsys=capsys)
    assert code == 0 and out.strip() == "un2", err
    assert "pre-flight: every Python file compiles; the job is not `python -m trainer train`" in err, err
    wait_until(lambda: not alive(pid))
    resumed = json.loads((env.runs / "un2" / "run.json").read_text())["extra"]["resumed_from"]
    assert resumed.startswith(str(env.runs / "un1" / "checkpoints" / "step_")), resumed
    wait_until(lambda: "resumed from" in (env.runs / "un2" / "train.log").read_text())


def test_a_run_that_has_ended_is_restarted_without_a_check(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    add_profile(env, "plain", PLAIN)
    pid = deploy_running(env, capsys, "plain", "dd1")
    code, _, err = env.cli("stop", "dd1", capsys=capsys)
    assert code == 0, err
    wait_until(lambda: not alive(pid))
    code, out, err = env.cli("restart", "--detach", "dd1", "--resume", capsys=capsys)  # nothing left to protect
    assert code == 0 and out.strip() == "dd2", err
    assert (env.runs / "dd2" / "run.json").exists()


def test_a_profile_check_refuses_a_bad_argument_before_the_old_run_is_stopped(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    pid = deploy_running(env, capsys, "work", "ck1")
    code, out, err = env.cli(
        "restart", "--detach", "ck1", "--name", "+", "--resume", "--", "--no-such-flag", "3", capsys=capsys
    )
    assert code == 2 and out == "", err
    error, hint = err.strip().splitlines()[-2:]
    assert error.startswith("error: local: pre-flight of the new code: the check of profile work exited with code 2: ")
    assert "workload.py: error: unrecognized arguments: --no-such-flag 3" in error, err  # the check's own stderr
    assert hint.startswith("hint: the check ran `") and "--check-only --no-such-flag 3`" in hint, err
    assert hint.endswith("the old run was not touched (--skip-preflight skips this check)"), err
    untouched(env, capsys, "ck1", pid, "ck2")

    # a check that passes: the restart goes on, and says what it ran (a phase line, a --json event)
    code, out, err = env.cli(
        "restart", "--detach", "ck1", "--resume", "--json", "--", "--interval", "0.04", capsys=capsys
    )
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    check = next(event for event in events if event["phase"] == "preflight")
    assert check["checks"] == "check" and check["command"].endswith("--check-only --interval 0.04"), check
    done = next(event for event in events if event["phase"] == "preflight_done")
    assert done["summary"].startswith("ok: the check `") and done["seconds"] > 0, done
    assert f"check: running `{check['command']}`" in err and "pre-flight: ok: the check `" in err, err
    wait_until(lambda: not alive(pid))
    argv = json.loads((env.runs / "ck2" / "run.json").read_text())["argv"]
    assert argv[argv.index("--interval") + 1] == "0.04", argv


def test_a_check_that_runs_past_its_time_limit_is_a_refusal(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    add_profile(env, "slowcheck", PLAIN + 'check: ["{python}", -c, "import time; time.sleep(30)"]\ncheck_timeout: 1\n')
    pid = deploy_running(env, capsys, "slowcheck", "sc1", "--skip-preflight")
    code, _, err = env.cli("restart", "--detach", "sc1", "--resume", capsys=capsys)
    assert code == 2, err
    assert "error: local: pre-flight of the new code: the check of profile slowcheck gave no verdict within 1 s" in err
    untouched(env, capsys, "sc1", pid, "sc2")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("check: python3 -c pass", "profiles.p.check: expected a list of strings"),
        ("check: []", "profiles.p.check: must not be empty"),
        ("check: [python3, [x]]", "profiles.p.check[1]: expected str"),
        ("check: [python3]\n    check_timeout: 0", "profiles.p.check_timeout: must be a positive number of seconds"),
        ("check: [python3]\n    check_timeout: soon", "profiles.p.check_timeout: expected int"),
        ("check_timeout: 5", "profiles.p.check_timeout: needs check: (the command it limits)"),
    ],
)
def test_a_bad_check_is_one_inventory_error(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(f"targets:\n  local: {{kind: local, workspace: ws}}\nprofiles:\n  p:\n    argv: [x]\n    {body}\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    assert message in caught.value.message and "\n" not in caught.value.message, caught.value.message
