"""The run directory's names are defined once: `RUN_FILES` in dflashops/agent/common.py (docs/run-directory.md).

The agent is shipped alone into the target and the trainer never imports dflashops, so the trainer spells its
own names in trainer/core/run_files.py. These tests hold the three places (the agent's table, the code on both sides,
the documentation) together:
- the trainer's names are exactly the table's rows written by the trainer, and no other trainer module spells
  one of them;
- every run-directory name the agent and its supervisor use is in the table (`os.path.join(<run dir>, NAME)`,
  the agent's own name constants), and every row the table gives them is used;
- the names the controller fetches are in the table;
- docs/run-directory.md's table lists exactly the table's names, each with its writer;
- what the trainer writes is what the agent reads: status.json's step, phase, pid and exit code, and the
  checkpoints/step_NNNNNN folders in step order.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from dflashops.agent import common, run_lock, stop, wrap
from dflashops.agent import status as agent_status
from dflashops.agent.fetch_files import FETCH_CACHE
from dflashops.ops.fetch import fetch
from trainer.core import run_files

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "run-directory.md"
DOC_TABLE = "## The files"  # the heading the table sits under
AGENT_FILES = tuple(sorted((REPO / "dflashops" / "agent").glob("*.py")))  # the agent's package, supervisor included
RUN_DIR_VARIABLES = {"directory", "old_dir"}  # how those files name a run directory (or `self.run_dir(...)`)
# How a writer of RUN_FILES is named in the documentation's "written by" column.
DOC_WRITER = {
    "agent": "agent",
    "supervisor": "supervisor",
    "trainer": "trainer",
    "wandb": "wandb",
    "trainer export": "trainer export",
    "none": "nobody",
}


def plain(name: str) -> str:
    return name.rstrip("/")


def rows_of(*writers: str) -> set[str]:
    return {plain(name) for name, writer in common.RUN_FILES.items() if writer in writers}


# ------------------------------------------------------------------------------------------- the names
def test_the_trainer_names_are_the_tables_trainer_rows() -> None:
    assert len(set(run_files.NAMES)) == len(run_files.NAMES)
    assert {name for name, writer in common.RUN_FILES.items() if writer == "trainer"} == set(run_files.NAMES)
    assert set(common.RUN_FILES.values()) <= set(DOC_WRITER), "a new kind of writer: name it in DOC_WRITER"


def trainer_literals() -> list[str]:
    """`path:line "name"` for every string literal in trainer/ (outside run_files.py) that is one of its names."""
    names = {
        run_files.STATUS,
        run_files.METRICS,
        run_files.TRAIN_CONFIG,
        run_files.CHECKPOINTS,
        run_files.CHECKPOINT_PREFIX,
    }
    found = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        if path.resolve() == Path(run_files.__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    return found


def test_the_trainer_spells_its_names_only_in_run_files() -> None:
    assert trainer_literals() == [], "use the constants of trainer/core/run_files.py"


def agent_code_names(path: Path) -> dict[str, int]:
    """name -> first line, for every `os.path.join(<run dir>, "NAME", ...)` in one of the agent's files."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join" and len(node.args) >= 2):
            continue
        head, name = node.args[0], node.args[1]
        run_dir = (isinstance(head, ast.Name) and head.id in RUN_DIR_VARIABLES) or (
            isinstance(head, ast.Call) and ast.unparse(head.func).endswith("run_dir")
        )
        if run_dir and isinstance(name, ast.Constant) and isinstance(name.value, str):
            found.setdefault(name.value, node.lineno)
    return found


def test_the_agent_and_the_supervisor_use_only_names_of_the_table() -> None:
    used: dict[str, str] = {}
    for path in AGENT_FILES:
        for name, line in agent_code_names(path).items():
            used.setdefault(name, f"{path.relative_to(REPO)}:{line}")
    constants = {
        wrap.LAUNCH_SPEC: "LAUNCH_SPEC",
        FETCH_CACHE: "FETCH_CACHE",
        run_lock.CONTROL: "CONTROL",
        **{f".{name}.reserved": "RESERVED_BYTES" for name in wrap.RESERVED_BYTES},
    }
    for name, where in constants.items():
        used.setdefault(name, f"dflashops/agent/ {where}")
    assert "run.json" in used and "stall.json" in used, "the scan found nothing: has the code's shape changed?"
    table = {plain(name) for name in common.RUN_FILES}
    unknown = {name: where for name, where in used.items() if name not in table}
    assert unknown == {}, "run-directory names missing from agent.RUN_FILES"
    assert rows_of("agent", "supervisor") - set(used) == set(), "RUN_FILES rows that no agent code writes"
    assert set(wrap.RESERVED_BYTES) <= table


def test_the_controller_fetches_names_of_the_table() -> None:
    table = {plain(name) for name in common.RUN_FILES}
    assert set(fetch.METADATA) | set(fetch.LOGS) <= table


def doc_rows() -> list[tuple[str, str]]:
    """(name, "written by" cell) for every row of the table under DOC_TABLE in docs/run-directory.md."""
    text = DOC.read_text(encoding="utf-8")
    assert DOC_TABLE + "\n" in text, f"{DOC.name} has no {DOC_TABLE!r} section"
    lines = text.split(DOC_TABLE + "\n", 1)[1].splitlines()
    table = []
    for line in lines:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    rows = []
    for line in table[2:]:  # after the header and the |---| line
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows.append((name, cells[1]))
    return rows


def test_the_documented_table_lists_exactly_the_names() -> None:
    rows = doc_rows()
    names = [name for name, _ in rows]
    assert sorted(names) == sorted(set(names)), "a name is listed twice"
    assert set(names) == set(common.RUN_FILES)
    for name, written_by in rows:
        writer = DOC_WRITER[common.RUN_FILES[name]]
        assert writer in written_by, f"{name}: the table says written by {written_by!r}, RUN_FILES {writer!r}"


# ------------------------------------------------------------------- what one writes, the other reads
def test_the_agent_reads_the_trainers_status_and_metrics(tmp_path: Path) -> None:
    from trainer.state.metrics import RunRecorder

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    recorder = RunRecorder(run, total_steps=10, heartbeat_s=60.0)
    try:
        recorder.log(
            {
                "step": 7,
                "epoch": 0,
                "loss": 2.5,
                "tau_sim": 1.5,
                "lr": 1e-3,
                "grad_norm": 0.5,
                "block_tok_s": 100.0,
                "eta_s": 3.0,
            }
        )
        recorder.set_status(phase="saving")
        assert stop.saving_checkpoint(str(run))  # phase and a fresh heartbeat
        recorder.set_status(phase="stopped", exit_code=143)
    finally:
        recorder.close()
    (run / "pid").write_text(f"{os.getpid() + 1}\n")  # the job the wrapper started: a launcher, not the trainer
    (run / "exit_code").write_text("1\n")  # what a launcher such as torchrun returns after its worker stopped
    status = agent_status.run_status(str(run))
    assert status["step"] == 7 and status["last_metrics"]["loss"] == 2.5
    assert (status["state"], status["exit_code"], status["launcher_exit_code"]) == ("stopped", 143, 1)


def test_the_agent_lists_the_trainers_checkpoints_in_step_order(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from trainer.state.checkpoint import save_checkpoint

    run = tmp_path / "runs" / "r1"
    for step in (5, 40, 100):
        save_checkpoint(
            run, step, model={"w": torch.zeros(2)}, optimizer={}, scheduler={}, epoch=0, index=step, extra={}, keep=3
        )
    (run / run_files.CHECKPOINTS / f".tmp-{run_files.CHECKPOINT_PREFIX}000200-1").mkdir()  # a save in flight
    listed = agent_status.run_status(str(run))["checkpoints"]
    assert listed == ["step_000005", "step_000040", "step_000100"]  # [-1] is the newest: restart, fetch, supervisor


def test_the_agent_and_the_trainer_agree_on_the_handover_contract(tmp_path: Path) -> None:
    """restart --resume's hand-over: the environment variable the agent sets for the new run is the one the
    trainer reads, and the offer the trainer writes into status.json is one the agent accepts (and a path
    outside the run's checkpoints/ one it refuses)."""
    import json

    from trainer.state.checkpoint import checkpoints_root
    from trainer.state.handover import RESUME_WRITER_ENV

    assert common.RESUME_WRITER_KEY == RESUME_WRITER_ENV
    run = tmp_path / "old"
    run.mkdir()
    inside = checkpoints_root(run) / f"{run_files.CHECKPOINT_PREFIX}000012"
    offer = {"checkpoint": str(inside), "step": 12, "devices_released": True}
    (run / run_files.STATUS).write_text(json.dumps({"handover": offer}))
    assert stop.handover_offer(str(run)) == {"checkpoint": str(inside), "step": 12}
    (run / run_files.STATUS).write_text(
        json.dumps({"handover": {**offer, "checkpoint": str(tmp_path / "x" / "step_000012")}})
    )
    assert stop.handover_offer(str(run)) is None
    (run / run_files.STATUS).write_text(json.dumps({"handover": {**offer, "devices_released": False}}))
    assert stop.handover_offer(str(run)) is None
