"""Issue 8 item 4: every launch carries the W&B naming of its lineage in its environment (run name =
dflashops name, group = lineage root, notes = the hypothesis, parent for the trainer's wandb config).
Checked in the real launched process of a three-run lineage built by a playbook."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.controller.helpers import INVENTORY, WORKLOAD, Env, cleanup

DUMP = (
    "import json,os; print('ENV ' + json.dumps({k: v for k, v in sorted(os.environ.items()) "
    "if k.startswith(('WANDB_', 'DFLASHOPS_RUN'))}))"
)


@pytest.fixture
def env(tmp_path: Path):
    shutil.copy(WORKLOAD, tmp_path / "workload.py")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        INVENTORY.format(python=sys.executable) + f'  envdump:\n    argv: ["{{python}}", "-c", {json.dumps(DUMP)}]\n'
    )
    setup = Env(root=tmp_path, inventory=inventory, workspace=tmp_path / "ws")
    yield setup
    cleanup(setup.workspace)


def test_lineage_reaches_wandb_env(
    env: Env, capsys: pytest.CaptureFixture[str], write: Callable[[str, str], Path]
) -> None:
    path = write(
        "lineage.yaml",
        """\
steps:
  - deploy: {profile: envdump, name: wb-a1, note: baseline}
  - deploy: {parent: wb-a1, note: "bigger lr"}
    register: child
  - deploy: {parent: "{{child.name}}", note: "longer warmup"}
    register: grandchild
  - wait: {run: "{{grandchild.name}}", log: "^ENV ", timeout: 20}
""",
    )
    code, out, err = env.cli("play", str(path), "--json", capsys=capsys)
    assert code == 0, err
    names = [step["detail"].split()[1] for step in json.loads(out)["steps"][:3]]
    assert names == ["wb-a1", "wb-a2", "wb-a3"]

    def launched_env(name: str) -> dict[str, str]:
        line = next(ln for ln in (env.runs / name / "train.log").read_text().splitlines() if ln.startswith("ENV "))
        return json.loads(line[4:])

    wanted = {
        "WANDB_NAME",
        "WANDB_RUN_GROUP",
        "WANDB_NOTES",
        "DFLASHOPS_RUN_NAME",
        "DFLASHOPS_RUN_PARENT",
        "DFLASHOPS_RUN_NOTE",
    }
    assert {k: v for k, v in launched_env("wb-a3").items() if k in wanted} == {
        "WANDB_NAME": "wb-a3",
        "WANDB_RUN_GROUP": "wb-a1",
        "WANDB_NOTES": "longer warmup",
        "DFLASHOPS_RUN_NAME": "wb-a3",
        "DFLASHOPS_RUN_PARENT": "wb-a2",
        "DFLASHOPS_RUN_NOTE": "longer warmup",
    }
    root = launched_env("wb-a1")
    assert root["WANDB_NAME"] == "wb-a1" and root["WANDB_RUN_GROUP"] == "wb-a1" and "DFLASHOPS_RUN_PARENT" not in root
