"""The edit -> restart loop made safe (issue 28, items 1 and 2): the new code and arguments are checked in the
target before the old run is stopped or a new one launched; resume from where the chain is; `--` on restart
merges with the parent's arguments. The real tiny trainer on the local target; the test's "edit" is a copy of a
trainer module listed in the profile's `files`, which replaces the package's own file in the release."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env
from tests.controller.test_ctl_reliability import add_profile, wait_until

pytestmark = pytest.mark.slow

SLOW = 240.0
PROFILE = """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "off", --log-interval, "1", --save-interval, "100000"]
resume_args: [--resume, "{checkpoint}"]
files: [trainer/state/metrics.py]
env: {TRAINER_TEST_MIN_STEP_S: "0.1"}  # a paced run: it trains on while the test restarts it (trainer/training/loop.py)
"""


@pytest.fixture
def edited(env: Env) -> Path:
    """The profile `tinyedit`, whose release takes trainer/state/metrics.py from the test's folder (returned)."""
    copy = env.root / "trainer" / "state" / "metrics.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(REPO / "trainer" / "state" / "metrics.py", copy)
    add_profile(env, "tinyedit", PROFILE)
    return copy


def deploy_running(env: Env, capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "tinyedit", "--name", name, "--launcher", "nohup", "--wait", r"^step 2/",
        "--timeout", str(SLOW), capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "pre-flight: ok: " in err  # the check ran, and said what it found


def state(env: Env, capsys: pytest.CaptureFixture[str], run: str) -> str:
    code, out, _ = env.cli("status", run, "--json", capsys=capsys)
    return str(json.loads(out)["runs"][0]["state"])


def names(env: Env, capsys: pytest.CaptureFixture[str]) -> set[str]:
    code, out, _ = env.cli("runs", "list", "--json", capsys=capsys)
    return {row["name"] for row in json.loads(out)}


def test_a_syntax_error_or_an_import_error_leaves_the_old_run_training(
    env: Env, capsys: pytest.CaptureFixture[str], edited: Path
) -> None:
    deploy_running(env, capsys, "pf1")
    good = edited.read_text()
    edited.write_text(good + "\ndef broken(:\n    pass\n")
    code, out, err = env.cli("restart", "--detach", "pf1", "--resume", "--name", "pf2", capsys=capsys)
    assert code == 2 and out == "", err
    line = len(good.splitlines()) + 2
    lines = err.strip().splitlines()
    assert lines[-2].startswith(
        f"error: local: pre-flight of the new code: trainer/state/metrics.py:{line}: SyntaxError"
    )
    assert lines[-1].startswith("hint: ") and "the old run was not touched" in lines[-1], err
    assert state(env, capsys, "pf1") == "running" and not (env.runs / "pf1" / "stop.json").exists()
    assert not (env.runs / "pf2").exists() and "pf2" not in names(env, capsys)  # no name used up, no row

    edited.write_text(good + "\nNOT_DEFINED_ANYWHERE + 1\n")  # compiles, fails when imported
    code, out, err = env.cli("restart", "--detach", "pf1", "--resume", "--name", "pf2", capsys=capsys)
    assert code == 2, err
    assert f"trainer/state/metrics.py:{line}: NameError: name 'NOT_DEFINED_ANYWHERE' is not defined" in err
    assert state(env, capsys, "pf1") == "running"

    edited.write_text(good)  # fixed: the restart goes through, and its pre-flight says so
    code, out, err = env.cli("restart", "--detach", "pf1", "--resume", "--name", "pf2", capsys=capsys)
    assert code == 0 and out.strip() == "pf2", err
    assert "pre-flight: ok: " in err


def test_bad_trainer_arguments_are_refused_before_anything_starts_or_stops(
    env: Env, capsys: pytest.CaptureFixture[str], edited: Path
) -> None:
    code, out, err = env.cli(
        "deploy", "--detach", "--profile", "tinyedit", "--name", "ba0", "--launcher", "nohup", "--", "--max-stepz", "3",
        capsys=capsys,
    )  # fmt: skip
    assert code == 2 and "unrecognized arguments: --max-stepz 3" in err, err
    assert "did you mean --max-steps?" in err, err
    assert not (env.runs / "ba0").exists() and "ba0" not in names(env, capsys)
    deploy_running(env, capsys, "ba1")
    code, out, err = env.cli("restart", "--detach", "ba1", "--resume", "--", "--max-steps", "abc", capsys=capsys)
    assert code == 2 and "argument --max-steps: invalid int value: 'abc'" in err, err
    assert state(env, capsys, "ba1") == "running"
    # --dry-run shows the verdict and changes nothing; --skip-preflight lets the check be skipped
    code, out, err = env.cli("restart", "ba1", "--resume", "--dry-run", capsys=capsys)
    assert code == 0 and "pre-flight: ok: " in err, err  # (its checkpoint is the one its stop will write)
    assert state(env, capsys, "ba1") == "running"
    code, out, err = env.cli(
        "restart", "--detach", "ba1", "--resume", "--name", "ba2", "--skip-preflight", capsys=capsys
    )
    assert code == 0 and "pre-flight" not in err, err


def test_restart_merges_its_arguments_with_the_parents_and_resumes_any_checkpoint_of_the_chain(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "ma1", "--launcher", "nohup", "--wait", "step 12", "--",
        "--save-every", "5", "--interval", "0.02", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    code, _, err = env.cli(
        "restart", "--detach", "ma1", "--resume", "--name", "ma2", "--", "--interval", "0.01", capsys=capsys
    )
    assert code == 0, err
    run_json = json.loads((env.runs / "ma2" / "run.json").read_text())
    assert run_json["extra"]["extra_args"] == ["--save-every", "5", "--interval", "0.01"]  # the parent's kept

    # Any checkpoint of the run or its ancestors: step 5 of ma1, from ma2.
    wait_until(lambda: "step" in (env.runs / "ma2" / "train.log").read_text())
    code, _, err = env.cli("restart", "--detach", "ma2", "--checkpoint", "5", "--name", "ma3", capsys=capsys)
    assert code == 0, err
    assert f"resuming from {env.runs / 'ma1' / 'checkpoints' / 'step_000005'}" in err
    wait_until(lambda: "at step 5" in (env.runs / "ma3" / "train.log").read_text())
    code, _, err = env.cli("restart", "--detach", "ma3", "--checkpoint", "999", capsys=capsys)
    assert code == 3 and "no checkpoint 999 in ma3 or its ancestors on local (steps: " in err, err
    assert state(env, capsys, "ma3") == "running"

    code, _, err = env.cli("restart", "--detach", "ma3", "--fresh", "--reset-args", "--name", "ma4", capsys=capsys)
    assert code == 0, err
    assert json.loads((env.runs / "ma4" / "run.json").read_text())["extra"]["extra_args"] == []
    code, _, err = env.cli("restart", "--detach", "ma4", "--", "--resume-from", "x", capsys=capsys)
    assert code == 2 and "dflashops restart RUN --resume --checkpoint STEP|PATH" in err, err
