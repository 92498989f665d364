"""Data for `dflashops watch`: one Snapshot of runs and GPUs, and a Watcher that survives dropped links.

Read-only by construction: it uses only the agent's `status` and `gpus` verbs (through ops.control's
run_status, which returns facts only) and never calls the observer (ops/runs/observer.py): nothing here signals,
writes into a run directory or the lineage, queues a notification or starts a supervisor. No printing here.

Cost per refresh: two agent calls per target (status + gpus), each one short command on the target.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dflashops.agent.answers import GpusAnswer
from dflashops.agent.protocol import GpusRequest
from dflashops.core.errors import DflashopsError
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import run_status
from dflashops.ops.runs.supervise import supervision_note

LIVE_STATES = ("launching", "running", "stopping")


@dataclass
class RunRow:
    name: str
    target: str
    state: str
    step: int | None = None
    total_steps: int | None = None
    phase: str | None = None
    loss: float | None = None
    tau_sim: float | None = None
    block_tok_s: float | None = None
    block_tok_s_per_drafter: list[float] = field(default_factory=list)
    queues: dict[str, str] = field(default_factory=dict)  # channel -> "depth/max"
    gpu_mem_gb: dict[str, float] = field(default_factory=dict)
    eta_s: float | None = None
    step_limit: str | None = None  # which limit ends the run: "max_steps" or "epochs" (status.json `step_limit`)
    heartbeat_age_s: float | None = None
    last_log_line: str | None = None
    error_line: str | None = None
    supervision: str | None = None  # ops/runs/supervise.py supervision_note: "supervised", "supervisor died, ..."
    exit_code: int | None = None
    restarted_as: str | None = None  # the run the in-target supervisor restarted this one as


@dataclass
class GpuRow:
    target: str
    index: int
    name: str
    memory_used_mib: int
    memory_total_mib: int
    utilization_pct: int


@dataclass
class Snapshot:
    taken_at: float  # unix seconds on this machine
    runs: list[RunRow]
    gpus: list[GpuRow]

    def to_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "runs": [asdict(r) for r in self.runs],
            "gpus": [asdict(g) for g in self.gpus],
        }


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def run_row(entry: dict[str, Any], now: float) -> RunRow:
    """One agent status entry -> the row the view shows (missing metrics stay None; an ended run has no eta
    and no heartbeat age)."""
    metrics = entry.get("last_metrics") or {}
    trainer = entry.get("trainer_status") or {}
    eta = _float(metrics.get("eta_s"))
    logged_at = _float(metrics.get("time"))
    if eta is not None and logged_at is not None and entry["state"] == "running":
        eta = max(0.0, eta - max(0.0, now - logged_at))  # the ETA was computed when the line was logged
    queues = {}
    for channel, stats in (metrics.get("queues") or {}).items():
        if isinstance(stats, dict):
            queues[str(channel)] = f"{stats.get('depth', '?')}/{stats.get('max', '?')}"
        else:
            queues[str(channel)] = str(stats)
    memory = metrics.get("gpu_mem_gb")
    memory_gb = _float(memory)  # one number for the whole target
    heartbeat = _float(trainer.get("heartbeat"))
    live = entry["state"] in LIVE_STATES
    if not live:  # an ended run has no time left and no heartbeat to age: both would only be stale numbers
        eta, heartbeat = None, None
    return RunRow(
        name=entry["name"] + (f"@node{entry['node']}" if "node" in entry else ""),
        target=str(entry.get("target", "")),
        state=entry["state"],
        step=entry.get("step"),
        total_steps=trainer.get("total_steps") if isinstance(trainer.get("total_steps"), int) else None,
        phase=trainer.get("phase"),
        loss=_float(metrics.get("loss")),
        tau_sim=_float(metrics.get("tau_sim")),
        block_tok_s=_float(metrics.get("block_tok_s")),
        block_tok_s_per_drafter=[v for v in (metrics.get("block_tok_s_per_drafter") or []) if _float(v) is not None],
        queues=queues,
        gpu_mem_gb={str(k): float(v) for k, v in memory.items()}
        if isinstance(memory, dict)
        else ({"0": memory_gb} if memory_gb is not None else {}),
        eta_s=eta,
        step_limit=trainer.get("step_limit") if trainer.get("step_limit") in ("max_steps", "epochs") else None,
        heartbeat_age_s=None if heartbeat is None else max(0.0, now - heartbeat),
        last_log_line=entry.get("last_log_line"),
        error_line=entry.get("error_line") or (entry.get("error") if entry["state"] == "unreachable" else None),
        supervision=supervision_note(entry),
        exit_code=entry.get("exit_code") if isinstance(entry.get("exit_code"), int) else None,
        restarted_as=entry.get("restarted_as"),
    )


def gather(invocation: Invocation, run: str | None, target: str | None = None) -> Snapshot:
    """Status of `run` (or of every run on the target when None) plus that target's GPUs.
    Raises NotFound for a run that does not exist (the agent says so), TransportError when unreachable."""
    entries = run_status(invocation, run, target=target)
    tgt = invocation.target_for_run(run, target) if run else invocation.inventory.target(target)
    answer = invocation.agent(tgt).ask("gpus", GpusRequest(), GpusAnswer)
    gpus = answer.gpus if answer is not None else []
    now = time.time()
    return Snapshot(
        taken_at=now,
        runs=[run_row(entry, now) for entry in entries],
        gpus=[
            GpuRow(
                target=tgt.name,
                index=g.index,
                name=g.name,
                memory_used_mib=g.memory_used_mib,
                memory_total_mib=g.memory_total_mib,
                utilization_pct=g.utilization_pct,
            )
            for g in gpus
        ],
    )


@dataclass
class Watcher:
    """Keeps the last good Snapshot. The first refresh raises (a run that does not exist is an error);
    later failures (dropped ssh link, stopped container) keep the old data, note the error, and the next
    refresh tries again (the ssh transport reconnects on its next command)."""

    invocation: Invocation
    run: str | None
    target: str | None = None
    clock: Callable[[], float] = time.time
    snapshot: Snapshot | None = None
    error: str | None = None
    failures: int = 0

    def refresh(self) -> Snapshot:
        try:
            snapshot = gather(self.invocation, self.run, self.target)
        except DflashopsError as exc:
            if self.snapshot is None:
                raise
            self.error, self.failures = exc.message.splitlines()[0], self.failures + 1
            return self.snapshot
        self.snapshot, self.error, self.failures = snapshot, None, 0
        return snapshot

    @property
    def stale_for(self) -> float | None:
        """Seconds since the last good data, while the connection is failing; None when fresh."""
        if self.error is None or self.snapshot is None:
            return None
        return max(0.0, self.clock() - self.snapshot.taken_at)

    def to_dict(self) -> dict[str, Any]:
        data = self.snapshot.to_dict() if self.snapshot else {"runs": [], "gpus": []}
        return {**data, "stale_for_s": self.stale_for, "error": self.error}
