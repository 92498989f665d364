"""Small output warts of issue 46 item 12, each typed as a user would: `status` cells in one format per column
(as the trainer's log line writes them), ..."""

from __future__ import annotations

import re

import pytest

from tests.controller.helpers import Env


def test_status_cells_have_one_format_per_column(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "nf1", "--launcher", "nohup", "--wait", "done", "--", "--steps", "3",
        "--interval", "0", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = env.cli("status", "nf1", capsys=capsys)
    assert code == 0, err
    # loss 10/3 and tau_sim 1.03 as the log line writes them: 4 and 3 decimals (were 3.333 and 1.03)
    assert re.search(r"^nf1\s+local\s+finished\s+3\s+3\.3333\s+1\.030\s+-\s", out, re.M), out


TINY = """\
  tiny:
    argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "2"]
"""


def test_an_ended_runs_last_lines_are_the_trainers_and_its_log_names_the_drafter(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DFlash2 run with wandb (offline: no key): `logs -f -n 2` after its end shows its last step and checkpoint,
    not wandb's run history and summary; its log says which drafter it trains."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env.inventory.write_text(env.inventory.read_text() + TINY)
    code, _, err = env.cli(
        "deploy", "--profile", "tiny", "--name", "d2", "--launcher", "nohup", "--",
        "--arch", "dflash2", "--num-attention-heads", "2", "--wandb", "on", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert env.cli("logs", "d2", "-f", "--timeout", "120", capsys=capsys)[0] == 0  # to its end
    code, out, err = env.cli("logs", "d2", "-f", "-n", "2", capsys=capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 2/2 | ") and "checkpoints/step_000002" in lines[1], out
    log = (env.runs / "d2" / "train.log").read_text()
    assert "wandb: " in log  # wandb ran (its start lines stay)
    assert "drafter: DFlash2, 2 layers, block 8, taps " in log
