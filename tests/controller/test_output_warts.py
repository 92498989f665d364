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
