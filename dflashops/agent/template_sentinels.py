"""The placeholders in a supervised run's launch template (ops/runs/supervise.py writes them, agent/supervisor.py
fills them for each child run): defined once here, a pure definition both sides import."""

from __future__ import annotations

SENTINELS = {
    "name": "@dflashops-run-name@",
    "parent": "@dflashops-parent@",
    "note": "@dflashops-note@",
    "checkpoint": "@dflashops-checkpoint@",
}
