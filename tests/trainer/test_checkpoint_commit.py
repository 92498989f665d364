"""A checkpoint whose writer died between its files and its rename (issue 27, item 2): whoever resumes commits it
when its data is complete, never when it is not. Real checkpoints written by trainer.state.checkpoint, then moved
back to the temporary name a killed writer leaves; real processes for the dead and the live writer.

- the agent (restart --resume, the supervisor): `commit_orphans`, stdlib only, judges completeness from the
  files themselves (state.json parses, the safetensors file is as long as its header says, the torch files end
  in their zip directory);
- the hand-over child (trainer/state/handover.py `commit_when_durable`): it has read the data whole already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflashops.agent import checkpoints as agent
from trainer.core.config import TrainerInputError
from trainer.state.checkpoint import save_checkpoint
from trainer.state.handover import commit_when_durable


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def orphan(run: Path, step: int, pid: int) -> tuple[Path, Path]:
    """A complete checkpoint `step` of `run`, left under the temporary name of writer `pid`: (tmp, final)."""
    model = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}}, "param_groups": []}
    final = save_checkpoint(
        run, step, model=model, optimizer=optimizer, scheduler={"last_epoch": step}, epoch=0, index=step, extra={},
        keep=5,
    )  # fmt: skip
    tmp = final.parent / f".tmp-{final.name}-{pid}"
    os.rename(final, tmp)
    return tmp, final


def test_the_agent_commits_a_complete_checkpoint_whose_writer_is_gone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_checkpoint(
        run, 2, model={"w": torch.zeros(2)}, optimizer={"state": {}, "param_groups": []}, scheduler={}, epoch=0,
        index=2, extra={}, keep=5,
    )  # fmt: skip
    tmp, final = orphan(run, 4, dead_pid())
    assert agent.latest_checkpoint(str(run)) == str(final)  # committed first, then the newest
    assert (final / "state.json").is_file() and not tmp.exists()
    assert json.loads((final / "state.json").read_text())["step"] == 4


@pytest.mark.parametrize("damage", ["model.safetensors", "optimizer.pt", "state.json"])
def test_the_agent_leaves_an_incomplete_checkpoint_alone(tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    tmp, final = orphan(run, 4, dead_pid())
    part = tmp / damage
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])  # cut mid-write
    assert agent.commit_orphans(str(run)) == []
    assert agent.latest_checkpoint(str(run)) is None and tmp.is_dir() and not final.exists()


def test_the_agent_leaves_a_live_writers_checkpoint_to_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tmp, final = orphan(run, 4, os.getpid())  # this process: alive, as a writer still fsyncing is
    assert agent.commit_orphans(str(run)) == [] and tmp.is_dir() and not final.exists()


def test_the_handover_child_commits_what_its_dead_writer_left_complete(tmp_path: Path) -> None:
    writer = tmp_path / "old"
    tmp, final = orphan(writer, 7, dead_pid())
    (writer / "exit_code").write_text("137\n")
    said = commit_when_durable(final, writer, tmp, timeout_s=30)
    assert said == f"committed {final}: old ended (exit code 137) after writing it, before making it durable"
    assert (final / "state.json").is_file() and not tmp.exists()


def test_the_handover_child_fails_naming_the_last_good_one_when_the_data_is_gone(tmp_path: Path) -> None:
    writer = tmp_path / "old"
    good = save_checkpoint(
        writer, 3, model={"w": torch.zeros(2)}, optimizer={"state": {}, "param_groups": []}, scheduler={}, epoch=0,
        index=3, extra={}, keep=5,
    )  # fmt: skip
    (writer / "exit_code").write_text("1\n")  # a failed fsync removes the temporary before the writer exits
    with pytest.raises(TrainerInputError) as caught:
        commit_when_durable(writer / "checkpoints" / "step_000007", writer, writer / "checkpoints" / ".tmp-gone-1")
    assert "old ended (exit code 1) without writing its final checkpoint step_000007" in caught.value.message
    assert caught.value.hint == f"restart from its last complete checkpoint: {good}"


def test_the_handover_child_says_nothing_when_the_writer_made_it_durable(tmp_path: Path) -> None:
    writer = tmp_path / "old"
    tmp, final = orphan(writer, 7, os.getpid())
    os.rename(tmp, final)  # the writer's own rename, done
    assert commit_when_durable(final, writer, tmp, timeout_s=30) is None
