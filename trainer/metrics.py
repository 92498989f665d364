"""Run-directory records (docs/run-directory.md): metrics.jsonl, status.json, the stdout progress line, wandb.

- `metrics.jsonl`: one JSON object per log step (step, epoch, loss terms, per-slot accuracy, tau_sim, lr,
  grad_norm, block_tok_s, ctx_tok_s, gpu memory, eta_s, time), appended and flushed line by line.
- `status.json`: rewritten atomically (temp file + rename) on every phase change, every log step and by a
  heartbeat thread every `heartbeat_s` seconds, so a long compile or checkpoint still shows a live
  heartbeat. Fields: phase (warmup | compiling | training | saving | stopped | done | failed), step,
  total_steps, heartbeat (unix seconds), heartbeat_iso, started_at, pid, last_checkpoint, error, exit_code,
  timeline (unix seconds of the start-up and shut-down milestones: `mark`), handover (trainer.handover).
  `stopped` = ended by a signal after a checkpoint (resumable).
- wandb is imported only when enabled; offline unless WANDB_API_KEY is set; any failure there is a warning.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.run_files import METRICS, STATUS

PHASES = ("warmup", "compiling", "training", "saving", "stopped", "done", "failed")
# Milestones before the recorder exists (set by `python -m trainer train`): copied into the timeline.
STARTUP_MARKS: dict[str, float] = {}


def _atomic_write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, sort_keys=True) + "\n")
    except OSError:
        tmp.unlink(missing_ok=True)  # a partial file on a full disk would keep holding its space
        raise
    os.replace(tmp, path)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class RunRecorder:
    """Writes the trainer's side of the run directory. Thread-safe; `close()` stops the heartbeat.

    `metrics=False` (the nodes other than node 0 of a distributed run): no metrics.jsonl and no wandb; `show`
    prints the progress line and refreshes status.json instead of `log`."""

    def __init__(self, run_dir: Path, total_steps: int, heartbeat_s: float = 15.0, *, metrics: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {
            "phase": "warmup",
            "step": 0,
            "total_steps": total_steps,
            "started_at": time.time(),
            "pid": os.getpid(),
            "last_checkpoint": None,
            "error": None,
            "exit_code": None,
            "timeline": dict(STARTUP_MARKS),
        }
        self._stop = threading.Event()
        self._wandb: Any = None
        if metrics:
            (self.run_dir / METRICS).touch()
        self.set_status(phase="warmup")
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), name="status-heartbeat", daemon=True)
        self._thread.start()

    # ---- status.json ----------------------------------------------------------------------------------
    def set_status(self, **fields: Any) -> None:
        assert fields.get("phase", "warmup") in PHASES, fields.get("phase")
        with self._lock:
            self._status.update(fields)
            self._write_status()

    def mark(self, event: str) -> None:
        """Record when `event` happened (status.json `timeline`): where a start or a stop spends its seconds
        (process start, imports, build, resume, warm-up, first step; stop, final snapshot, release, write).
        The first time counts: a mark is never moved."""
        with self._lock:
            self._status["timeline"].setdefault(event, round(time.time(), 3))
            self._write_status()

    def _write_status(self) -> None:
        now = time.time()
        self._status["heartbeat"] = now
        self._status["heartbeat_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        _atomic_write_json(self.run_dir / STATUS, self._status)

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                try:
                    self._write_status()
                except OSError:  # e.g. a full disk: the next beat retries; the run reports its own failure
                    pass

    # ---- metrics --------------------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics line, print the progress line, forward to wandb, refresh status."""
        line = json.dumps(record, sort_keys=True, allow_nan=True)
        # Opened per line (a log step is seconds apart): `truncate_metrics` may have replaced the file since.
        with open(self.run_dir / METRICS, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        print(progress_line(record, self.total_steps), flush=True)
        if self._wandb is not None:
            try:
                self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
            except Exception as exc:  # noqa: BLE001 - wandb must never stop training
                print(f"warning: wandb.log failed ({exc}); disabling wandb", file=sys.stderr)
                self._wandb = None
        self.set_status(step=record["step"])

    def show(self, record: dict[str, Any]) -> None:
        """Print the progress line of a metrics record and refresh status.json, without writing metrics.jsonl."""
        print(progress_line(record, self.total_steps), flush=True)
        self.set_status(step=record["step"])

    def open_wandb(self, mode: str, project: str, run_name: str | None, config: dict[str, Any]) -> None:
        """mode auto|on|off. Offline unless WANDB_API_KEY is set. Never fatal."""
        if mode == "off":
            return
        try:
            import wandb  # lazy: a heavy import, and optional
        except ImportError:
            if mode == "on":
                print("warning: --wandb on but wandb is not installed; continuing without it", file=sys.stderr)
            return
        try:
            self._wandb = wandb.init(
                project=project,
                dir=str(self.run_dir),
                **wandb_lineage(run_name, config, os.environ),
                mode="online" if os.environ.get("WANDB_API_KEY") else "offline",
            )
        except Exception as exc:  # noqa: BLE001
            print(f"warning: wandb.init failed ({exc}); continuing without it", file=sys.stderr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:  # noqa: BLE001
                pass


def truncate_metrics(run_dir: Path, after_step: int) -> int:
    """On resume: drop metrics lines of steps > after_step (they are about to be redone); return how many."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped += 1  # a torn last line from a hard kill
            continue
        if step <= after_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{METRICS}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """One human line per log step: step, epoch, loss, tau_sim, lr, block tok/s, ETA."""
    return (
        f"step {record['step']}/{total_steps} | epoch {record['epoch']} | loss {record['loss']:.4f} | "
        f"tau_sim {record['tau_sim']:.3f} | lr {record['lr']:.2e} | grad_norm {record['grad_norm']:.3f} | "
        f"block tok/s {record['block_tok_s']:,.0f} | eta {format_eta(record['eta_s'])}"
    )


def wandb_lineage(run_name: str | None, config: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """wandb.init kwargs that mirror the dflashops lineage: name = the run's name, group = the lineage root,
    notes = the hypothesis, and config["dflashops"] = {run, parent, note} (dflashops sets DFLASHOPS_RUN_NAME,
    DFLASHOPS_RUN_PARENT, DFLASHOPS_RUN_NOTE and WANDB_RUN_GROUP in the launched process's environment)."""
    lineage = {
        key: environ[var]
        for key, var in (
            ("run", "DFLASHOPS_RUN_NAME"),
            ("parent", "DFLASHOPS_RUN_PARENT"),
            ("note", "DFLASHOPS_RUN_NOTE"),
        )
        if environ.get(var)
    }
    kwargs: dict[str, Any] = {
        "name": run_name or environ.get("DFLASHOPS_RUN_NAME") or None,
        "config": {**config, "dflashops": lineage} if lineage else dict(config),
    }
    if environ.get("WANDB_RUN_GROUP"):
        kwargs["group"] = environ["WANDB_RUN_GROUP"]
    if environ.get("DFLASHOPS_RUN_NOTE"):
        kwargs["notes"] = environ["DFLASHOPS_RUN_NOTE"]
    return kwargs
