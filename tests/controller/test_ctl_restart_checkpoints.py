"""`restart --resume` and the checkpoints it resumes (issue 45 items 7 and 2): the real tiny trainer on the local
target, training and rotating its checkpoints (--save-interval 2, the trainer's newest three kept) while it is
restarted.

- A checkpoint the running parent rotates away during the pre-flight: the pre-flight read it from a hold (hard
  links beside it), so the restart goes through; a `--checkpoint N` rotated away meanwhile is put back for the
  child, which resumes exactly it. The test's release makes the pre-flight slow (its copy of trainer/training/preflight.py
  waits, in `trainer check` only, until the checkpoint named by --resume is gone from its run's folder), so the
  rotation always wins the race the issue saw 1 time in 5.
- "passed its start" is the child's first step (the timeline's `first_step`), after its resume loaded.
- A damaged resume checkpoint (model.safetensors cut, state.json cut, optimizer.pt missing) is refused before
  anything is stopped: one `error:` naming the file and the last good checkpoint, the parent trains on."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env
from tests.controller.test_ctl_reliability import add_profile, wait_until

pytestmark = pytest.mark.slow

SLOW = 240.0
PROFILE = """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "off", --log-interval, "1", --save-interval, "2"]
resume_args: [--resume, "{checkpoint}"]
files: [trainer/training/preflight.py]
env: {TRAINER_TEST_MIN_STEP_S: "0.1"}  # a paced run: it trains (and rotates) on while the test restarts it
"""
# Inserted at the top of the release's `preflight()`: in `trainer check` only (the pre-flight), wait until the
# checkpoint --resume names (the original, whichever hold folder the agent passed) has been rotated away.
SLOW_CHECK = """
    import sys as _sys, time as _time, re as _re, os as _os
    if _sys.argv[1:2] == ["check"] and cfg.resume not in (None, "auto", "never"):
        _original = _re.sub(r"/\\.hold-(step_\\d+)-\\d+$", r"/\\1", str(cfg.resume))
        _deadline = _time.monotonic() + 60
        while _os.path.exists(_os.path.join(_original, "state.json")) and _time.monotonic() < _deadline:
            _time.sleep(0.05)
"""


@pytest.fixture
def rotating(env: Env) -> None:
    """The profile `tinyrot`: the tiny trainer saving every 2 steps, its pre-flight slow (SLOW_CHECK)."""
    source = (REPO / "trainer" / "training" / "preflight.py").read_text()
    anchor = '    node 0 reads them and sends what it read to every node."""\n'
    assert anchor in source
    copy = env.root / "trainer" / "training" / "preflight.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(source.replace(anchor, anchor + SLOW_CHECK, 1))
    add_profile(env, "tinyrot", PROFILE)


def deploy_training(
    env: Env, capsys: pytest.CaptureFixture[str], name: str, until: str = r"^step 7/", profile: str = "tinyrot"
) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", profile, "--name", name, "--launcher", "nohup", "--skip-preflight",
        "--wait", until, "--timeout", str(SLOW), capsys=capsys,
    )  # fmt: skip
    assert code == 0, err


def run_state(env: Env, capsys: pytest.CaptureFixture[str], run: str) -> str:
    code, out, _ = env.cli("status", run, "--json", capsys=capsys)
    return str(json.loads(out)["runs"][0]["state"])


def checkpoints(env: Env, run: str) -> list[str]:
    root = env.runs / run / "checkpoints"
    return sorted(n for n in os.listdir(root) if n.startswith("step_")) if root.is_dir() else []


def test_a_checkpoint_rotated_away_during_the_preflight_does_not_fail_the_restart(
    env: Env, capsys: pytest.CaptureFixture[str], rotating: None
) -> None:
    deploy_training(env, capsys, "rot1")
    code, out, err = env.cli("restart", "rot1", "--resume", "--name", "rot2", "--timeout", str(SLOW), capsys=capsys)
    assert code == 0 and out.strip() == "rot2", err
    assert "not a complete checkpoint" not in err
    assert "pre-flight: ok: " in err
    resumed = json.loads((env.runs / "rot2" / "run.json").read_text())["extra"]["resumed_from"]
    assert f"resuming from {resumed}" in err
    # Started = the first step after the resume: its timeline has both, and the log says where it resumed.
    timeline = json.loads((env.runs / "rot2" / "status.json").read_text())["timeline"]
    assert "resumed" in timeline and "first_step" in timeline, timeline
    assert re.search(r"rot2 passed its start: status\.json timeline `first_step`", err), err
    assert f"resumed from {resumed}" in (env.runs / "rot2" / "train.log").read_text()
    assert not [n for n in os.listdir(env.runs / "rot1" / "checkpoints") if n.startswith(".hold-")]


def test_a_chosen_checkpoint_rotated_away_during_the_preflight_is_put_back_for_the_child(
    env: Env, capsys: pytest.CaptureFixture[str], rotating: None
) -> None:
    # A step a second: a checkpoint lives ~6 s before the rotation deletes it, time enough for the restart to
    # reach the agent with it (a --checkpoint already gone by then is refused as not there: nothing to hold).
    add_profile(env, "tinyrot1s", PROFILE.replace('TRAINER_TEST_MIN_STEP_S: "0.1"', 'TRAINER_TEST_MIN_STEP_S: "1.0"'))
    deploy_training(env, capsys, "cho1", until=r"^step 3/", profile="tinyrot1s")
    chosen = checkpoints(env, "cho1")[-1]
    step = str(int(chosen.removeprefix("step_")))
    code, out, err = env.cli(
        "restart", "cho1", "--checkpoint", step, "--name", "cho2", "--timeout", str(SLOW), capsys=capsys
    )
    assert code == 0, err
    path = env.runs / "cho1" / "checkpoints" / chosen
    assert f"resuming from {path}" in err
    assert (path / "state.json").is_file()  # put back: the parent's rotation had deleted it
    assert f"resumed from {path} at step {step}" in (env.runs / "cho2" / "train.log").read_text()


def damage_model(checkpoint: Path) -> str:
    weights = checkpoint / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return "model.safetensors is cut short"


def damage_state(checkpoint: Path) -> str:
    state = checkpoint / "state.json"
    os.truncate(state, 40)
    return "state.json is cut short or not JSON"


def damage_optimizer(checkpoint: Path) -> str:
    (checkpoint / "optimizer.pt").unlink()
    return "optimizer.pt is missing"


@pytest.mark.parametrize("damage", [damage_model, damage_state, damage_optimizer])
def test_a_damaged_checkpoint_is_refused_before_the_parent_is_stopped(
    env: Env, capsys: pytest.CaptureFixture[str], damage
) -> None:
    add_profile(env, "tinysave", PROFILE.replace("files: [trainer/training/preflight.py]\n", ""))
    # dm0 ends at step 6 with steps 2, 4, 6 (nothing rotates them any more); its child dm1 trains on.
    code, _, err = env.cli(
        "deploy", "--profile", "tinysave", "--name", "dm0", "--launcher", "nohup", "--skip-preflight", "--detach",
        "--", "--max-steps", "6", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    wait_until(lambda: run_state(env, capsys, "dm0") == "finished", timeout=SLOW)
    code, _, err = env.cli(
        "deploy", "--profile", "tinysave", "--name", "dm1", "--parent", "dm0", "--launcher", "nohup",
        "--skip-preflight", "--wait", r"^step 2/", "--timeout", str(SLOW), "--", "--save-interval", "100000",
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    bad, good = (env.runs / "dm0" / "checkpoints" / f"step_00000{n}" for n in (6, 4))
    what = damage(bad)
    code, out, err = env.cli("restart", "--detach", "dm1", "--checkpoint", "6", "--name", "dm2", capsys=capsys)
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert lines[-2] == (
        f"error: local: pre-flight of the new code: checkpoint {bad} cannot be loaded: {what}"
        + lines[-2].split(what, 1)[1]
    )
    assert lines[-2].endswith(f"; last good checkpoint: {good}") and "Traceback" not in err, err
    assert lines[-1].startswith("hint: resume from that one: --checkpoint 4; the old run was not touched"), err
    assert run_state(env, capsys, "dm1") == "running" and not (env.runs / "dm1" / "stop.json").exists()
    assert not (env.runs / "dm2").exists()
