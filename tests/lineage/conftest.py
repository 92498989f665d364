"""Fixtures for the lineage tests: a real SQLite file in tmp_path and a three-run lineage with metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashops.lineage import LineageDB, RunRecord


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "lineage.sqlite"


@pytest.fixture
def db(db_path: Path):
    database = LineageDB(db_path)
    yield database
    database.close()


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


@pytest.fixture
def three_runs(db: LineageDB, tmp_path: Path) -> dict:
    """exp-flex5 -> exp-flex6 -> exp-flex7, each with a local run dir holding metrics.jsonl.

    flex6 changes --lr and the code hash; flex7 adds --compile. tau_sim peaks at 1.5, 2.0, 2.5."""
    runs_root = tmp_path / "ws" / "runs"
    specs = [
        ("exp-flex5", None, "1e-4", []),
        ("exp-flex6", "exp-flex5", "3e-4", []),
        ("exp-flex7", "exp-flex6", "3e-4", ["--compile"]),
    ]
    for index, (name, parent, lr, extra_args) in enumerate(specs):
        run_dir = runs_root / name
        rows = [
            {
                "step": step,
                "loss": 4.0 / (1 + step * (index + 1) / 20),
                "tau_sim": 1.0 + step / 40 * (index + 1) / 2,
                "block_tok_s": [1000.0 + 100 * index, 900.0],
            }
            for step in range(0, 41, 10)
        ]
        write_metrics(run_dir, rows)
        db.record(
            RunRecord(
                name=name,
                parent=parent,
                note=f"hypothesis {index}",
                code_hash=("ab" if index == 0 else "cd") * 20,
                argv=["python", "-m", "trainer", "train", "--lr", lr, "--batch", "8", *extra_args],
                env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WANDB_API_KEY": "0123456789abcdef0123"},
                target="local",
                gpus=[0, 1],
                profile="tiny",
                extra={"run_dir": str(run_dir)},
            )
        )
    db.set_state("exp-flex5", "finished", exit_code=0, last_step=40)
    db.set_state("exp-flex6", "crashed", exit_code=1, last_step=8)
    return {"runs_root": runs_root, "names": [spec[0] for spec in specs]}
