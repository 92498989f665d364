"""Issue 29, item 9 (the trainer's small ones): `train --help` without torch, one spelling of --enable-thinking
that every verb takes both ways, and a log line when a resume's --max-steps changes the LR schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.__main__ import main as trainer_main
from trainer.core.config import build_parser
from trainer.data.prepare import build_parser as prepare_parser

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--preset", "tiny", "--synthetic-samples", "48", "--max-seq-len", "32", "--token-budget", "128"]


def test_item9_train_help_does_not_import_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trainer", "train", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.returncode == 0 and "--max-steps" in done.stdout, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "trainer.core.train_help" in imported  # the flags' help texts: this is the list of what was imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "numpy")}, imported
    assert "trainer.train" not in imported


@pytest.mark.parametrize("word", ["on", "off", "true", "false"])
def test_item9_enable_thinking_takes_on_off_and_true_false_in_train_prepare_and_eval(word: str) -> None:
    expected = word in ("on", "true")
    assert build_parser().parse_args(["--enable-thinking", word]).enable_thinking is expected
    required = ["--target-model", "m", "--input", "i", "--output-dir", "o"]
    assert prepare_parser().parse_args([*required, "--enable-thinking", word]).enable_thinking is expected
    # eval's parser is built inside its main: its flag uses the same converter as prepare's
    from trainer.evaluation import eval as trainer_eval

    assert "type=_on_off" in Path(trainer_eval.__file__).read_text()


def test_item9_enable_thinking_has_one_documented_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    for verb in ("train", "prepare", "eval"):
        try:
            assert trainer_main([verb, "--help"]) == 0
        except SystemExit as exc:  # argparse's own --help
            assert exc.code == 0
        text = capsys.readouterr().out
        assert "--enable-thinking [on|off]" in text or "--enable-thinking on|off" in text, (verb, text)
        assert "true|false]" not in text.split("--enable-thinking", 1)[1].split("\n", 1)[0]


def test_item9_a_resume_with_a_larger_max_steps_logs_the_new_lr_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    common = ["train", *SMALL, "--wandb", "off", "--log-interval", "1", "--output-dir", str(run)]
    assert trainer_main([*common, "--max-steps", "4", "--save-interval", "4"]) == 0
    capsys.readouterr()
    assert trainer_main([*common, "--max-steps", "8", "--resume", "auto"]) == 0
    log = capsys.readouterr()
    line = next(
        (ln for ln in (log.out + log.err).splitlines() if "the learning-rate schedule is recomputed" in ln), None
    )
    assert line is not None, log.out + log.err
    assert "--max-steps 8 (the checkpoint's run had 4)" in line and "to end at step 8" in line
    assert "LR at step 4: " in line and " -> " in line
    capsys.readouterr()
    assert trainer_main([*common, "--max-steps", "8", "--resume", "auto"]) == 0  # same --max-steps: no line
    log = capsys.readouterr()
    assert "learning-rate schedule" not in log.out + log.err
