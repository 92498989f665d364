"""The "resumed from" log line comes after status.json has the resumed step and checkpoint: a reader that saw the
line (a user, a test, a playbook's wait on the log) and then read the status used to find the old values there
under load (CI, 2026-12-07: tests/controller/test_ctl_handover.py read `last_checkpoint` None)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import trainer.training.loop as loop
from tests.trainer.tiny import tiny_train_config
from trainer.train import EXIT_OK
from trainer.train import run as run_single

pytestmark = pytest.mark.timeout(180)


def test_the_status_has_the_resumed_checkpoint_when_the_log_says_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "run"
    assert run_single(tiny_train_config(out, "--max-steps", "2", "--save-interval", "2")) == EXIT_OK
    seen: list[dict] = []
    say = loop.log

    def log_and_read_status(message: str) -> None:
        if message.startswith("resumed from"):
            seen.append(json.loads((out / "status.json").read_text()))
        say(message)

    monkeypatch.setattr(loop, "log", log_and_read_status)
    assert run_single(tiny_train_config(out, "--max-steps", "3", "--resume", "auto")) == EXIT_OK
    assert len(seen) == 1, "no 'resumed from' line was logged"
    assert seen[0]["step"] == 2 and seen[0]["last_checkpoint"] == str(out / "checkpoints" / "step_000002")
