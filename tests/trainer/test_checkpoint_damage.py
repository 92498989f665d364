"""Damaged checkpoints (issue 45 item 2): `python -m trainer train --resume` and `python -m trainer export` (both
formats) of a checkpoint whose model.safetensors is cut, whose state.json is cut, or whose optimizer.pt is missing
say one `error:` line naming the file and the last good checkpoint, then a `hint:`, exit 2, no traceback. The
checkpoints are a real tiny run's (steps 2, 4, 6); the damage is done to step 6."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer.state.checkpoint import checkpoint_damage

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--preset", "tiny", "--wandb", "off", "--log-interval", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def trainer(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m trainer ARGV`, as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run directory with checkpoints at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("damage")
    done = trainer("train", *TRAIN, "--output-dir", "run", "--max-steps", "6", "--save-interval", "2", cwd=root)
    assert done.returncode == 0, done.stderr
    return root / "run"


def cut_model(checkpoint: Path) -> str:
    weights = checkpoint / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    return "model.safetensors is cut short"


def cut_state(checkpoint: Path) -> str:
    os.truncate(checkpoint / "state.json", 40)
    return "state.json is cut short or not JSON"


def lose_optimizer(checkpoint: Path) -> str:
    (checkpoint / "optimizer.pt").unlink()
    return "optimizer.pt is missing"


@pytest.fixture(params=[cut_model, cut_state, lose_optimizer])
def damaged(request: pytest.FixtureRequest, trained: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the run with step 6 damaged; (that checkpoint, the words that name the damage)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damage: Callable[[Path], str] = request.param
    bad = run / "checkpoints" / "step_000006"
    return bad, damage(bad)


def one_error(done: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """(the error line, the hint line) of a refusal that says nothing else on stderr."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), done.stderr
    return lines[0], lines[1]


def test_train_resume_of_a_damaged_checkpoint_names_the_file_and_the_last_good_one(
    damaged: tuple[Path, str], tmp_path: Path
) -> None:
    bad, what = damaged
    good = bad.parent / "step_000004"
    done = trainer("train", *TRAIN, "--output-dir", "child", "--max-steps", "8", "--resume", str(bad), cwd=tmp_path)
    error, hint = one_error(done)
    assert error == f"error: --resume: checkpoint {bad} cannot be loaded: {what}" + error.split(what, 1)[1]
    assert error.endswith(f"; last good checkpoint: {good}")
    assert hint == f"hint: use that one: --resume {good}"
    assert not (tmp_path / "child").exists()  # refused in the pre-flight: nothing written


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export_of_a_damaged_checkpoint_names_the_file_and_the_last_good_one(
    damaged: tuple[Path, str], tmp_path: Path, fmt: str
) -> None:
    bad, what = damaged
    done = trainer("export", str(bad), "--output", "out", "--format", fmt, cwd=tmp_path)
    if what == "optimizer.pt is missing":  # export reads the weights and the config only: it goes on
        assert fmt == "speculators" or done.returncode == 0, done.stderr
        return
    error, hint = one_error(done)
    good = bad.parent / "step_000004"
    assert error.startswith(f"error: checkpoint {bad} cannot be exported: {what}")
    assert error.endswith(f"; last good checkpoint: {good}")
    assert hint == f"hint: export that one: python -m trainer export {good} --output DIR"
    assert not (tmp_path / "out").exists()


def test_a_whole_checkpoint_has_no_damage_and_the_last_good_one_skips_damaged_ones(trained: Path) -> None:
    assert checkpoint_damage(trained / "checkpoints" / "step_000006") is None
