"""Small output warts of issue 46 item 12, each typed as a user would: `status` cells in one format per column
(as the trainer's log line writes them); an ended run's last log lines are the trainer's, not wandb's, and its log
names the drafter; `runs diff` names the files that changed between two code hashes."""

from __future__ import annotations

import json
import re
import shutil

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


def test_runs_diff_names_the_files_that_changed(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`runs diff A B` of two runs whose code differs names the files, read from the target's two releases."""
    assert env.deploy_one_step("cd1", capsys) == 0
    workload = env.root / "workload.py"
    workload.write_text(workload.read_text() + "\n# an edit\n")
    assert env.deploy_one_step("cd2", capsys) == 0
    code, out, err = env.cli("runs", "diff", "cd1", "cd2", capsys=capsys)
    assert code == 0, err
    assert "\n  ~ code_hash: " in out and "\n    file changed: workload.py\n" in out, out
    code, out, _ = env.cli("runs", "diff", "cd1", "cd2", "--json", capsys=capsys)
    assert json.loads(out)["files"] == {"changed": [{"how": "M", "path": "workload.py"}], "unknown": None}
    # a release gc removed: not known, and why
    release = json.loads((env.runs / "cd1" / "run.json").read_text())["release"]
    shutil.rmtree(release)
    code, out, err = env.cli("runs", "diff", "cd1", "cd2", capsys=capsys)
    assert code == 0 and "    files: not known (release " in out and "is no longer on local: gc removed it)" in out
