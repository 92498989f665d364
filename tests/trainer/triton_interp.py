"""Running Triton kernels under the CPU interpreter for a test module: one child process for all its cases.

TRITON_INTERPRET=1 changes how every Triton kernel of a process runs, so it is set only in the child (a
`*_interp_worker.py` script: `python WORKER CASES_IN OUTPUTS_OUT`, both torch.save files); one child for all of a
module's cases pays the interpreter's start once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[2]


def interpret_cases(worker: Path, cases: dict, folder: Path) -> dict:
    """{"cases": cases, "out": the worker's outputs by case name}; the child's stderr tail on failure."""
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(worker), str(folder / "cases.pt"), str(folder / "out.pt")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed goal: ~35 s on an idle 2-core machine, 240 s was hit under load
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return {"cases": cases, "out": torch.load(folder / "out.pt")}


def reset_ladder(module: ModuleType, defaults: list, case: dict) -> None:
    """Before a case of a kernel `module` that launches through trainer/kernels/triton_fit.py: its ladder the case's
    "configs" (else `defaults`), no remembered verdicts or logged fallbacks, $DFLASH_SMEM_LIMIT the case's "smem"."""
    from trainer.kernels import triton_fit

    module.CONFIGS[:] = case.get("configs", defaults)
    triton_fit._VERDICT.clear()
    module._LOGGED.clear()
    os.environ.pop(triton_fit.SMEM_ENV, None)
    if case.get("smem"):
        os.environ[triton_fit.SMEM_ENV] = case["smem"]


def serve_cases(run_case: Callable[[dict], dict], argv: list[str]) -> int:
    """A worker's main: `argv` = [CASES_IN, OUTPUTS_OUT]; runs every case, saves {name: run_case(case)}."""
    cases = torch.load(argv[0])
    torch.save({name: run_case(case) for name, case in cases.items()}, argv[1])
    return 0
