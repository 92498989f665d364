"""W&B mirrors the dflashops lineage: run name, group = lineage root, parent and note in the config (offline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.state.metrics import wandb_lineage

REPO = Path(__file__).resolve().parents[2]
LINEAGE_ENV = {
    "DFLASHOPS_RUN_NAME": "exp-flex6",
    "DFLASHOPS_RUN_PARENT": "exp-flex5",
    "DFLASHOPS_RUN_NOTE": "gamma 5 instead of 7",
    "WANDB_RUN_GROUP": "exp-flex",
}


def test_lineage_kwargs_from_the_environment() -> None:
    kwargs = wandb_lineage(None, {"lr": 1e-3}, LINEAGE_ENV)
    assert kwargs["name"] == "exp-flex6" and kwargs["group"] == "exp-flex" and kwargs["notes"] == "gamma 5 instead of 7"
    assert kwargs["config"] == {
        "lr": 1e-3,
        "dflashops": {"run": "exp-flex6", "parent": "exp-flex5", "note": "gamma 5 instead of 7"},
    }
    assert wandb_lineage("explicit", {}, LINEAGE_ENV)["name"] == "explicit"  # --wandb-run-name wins
    plain = wandb_lineage(None, {"lr": 1}, {})
    assert plain == {"name": None, "config": {"lr": 1}}


def test_offline_run_records_the_lineage(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(LINEAGE_ENV, WANDB_SILENT="true", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--preset",
            "tiny",
            "--max-steps",
            "2",
            "--log-interval",
            "1",
            "--output-dir",
            str(out),
            "--wandb",
            "on",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(records) == 1, sorted(p.name for p in out.rglob("*"))[:20]
    data = records[0].read_bytes()  # wandb's record log (protobuf): the strings appear verbatim
    for text in ("exp-flex6", "exp-flex5", "gamma 5 instead of 7", "exp-flex"):
        assert text.encode() in data, text
