"""Run-directory records (docs/run-directory.md): metrics.jsonl, status.json, train_config.json, the stdout
progress line, wandb.

- `metrics.jsonl`: one JSON object per log step (step, epoch, loss terms, per-slot accuracy, tau_sim, lr,
  grad_norm, block_tok_s, ctx_tok_s, gpu memory, eta_s, time), appended line by line, each whole or not at all.
- `status.json`: rewritten atomically (temp file + rename) on every phase change, every log step and by a
  heartbeat thread every `heartbeat_s` seconds, so a long compile or checkpoint still shows a live
  heartbeat. Fields: phase (warmup | compiling | training | saving | stopped | done | failed), step,
  total_steps, heartbeat (unix seconds), heartbeat_iso, started_at, pid, last_checkpoint, error, exit_code,
  timeline (unix seconds of the start-up and shut-down milestones: `mark`), handover (trainer.state.handover).
  `stopped` = ended by a signal after a checkpoint (resumable).
- wandb is imported only when enabled; offline unless WANDB_API_KEY is set; any failure there is a warning.

A full disk (issue 27, item 8): a record that cannot be written raises `NoSpaceError` ("no space left on MOUNT
while writing PATH"), which ends the run with one `error:` line (trainer.state.failure). The run's last status.json
(`failed`, `done`, `stopped`) must land even then, or status.json would say `training` for a dead pid: `start`
sets aside `.status.json.reserved` while there is room, and a final write that gets no new block is written into
it in place and renamed over status.json (the agent does the same for `exit_code` and `stop.json`). Overwriting
allocated blocks needs no new ones on ext4, xfs and tmpfs; a copy-on-write filesystem (btrfs, zfs) may still
refuse it, and the failure is then on stderr only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainer.core.diskspace import NoSpaceError, as_no_space
from trainer.core.lines import append_whole, say
from trainer.core.run_files import METRICS, STATUS, STATUS_RESERVE, TRAIN_CONFIG

PHASES = ("warmup", "compiling", "training", "saving", "stopped", "done", "failed")
FINAL_PHASES = ("stopped", "done", "failed")  # the last record of a process: written into the reserve if need be
# The reserve's size: a status.json is ~1-3 KiB (timeline, hand-over), plus an `error` of up to 2000 characters
# (trainer.state.failure), which JSON may escape to 6 bytes each. 16 KiB costs nothing next to a checkpoint.
STATUS_RESERVE_BYTES = 16384
# Heartbeat writes in a row that may fail before the run is ended (see `RunRecorder._beat`).
HEARTBEAT_TRIES = 2
# Milestones before the recorder exists (set by `python -m trainer train`): copied into the timeline.
STARTUP_MARKS: dict[str, float] = {}


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A full disk's error while writing `path` becomes NoSpaceError, naming `path` and its filesystem."""
    try:
        yield
    except OSError as exc:
        full = as_no_space(exc, path)
        if full is None:
            raise
        raise full from exc


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _writing(path):
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)  # can fail too where a folder needs a new block for the name
        except OSError:
            tmp.unlink(missing_ok=True)  # a partial file on a full disk would keep holding its space
            raise


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class RunRecorder:
    """Writes the trainer's side of the run directory. Thread-safe. `start()` sets aside status.json's reserve,
    writes status.json and metrics.jsonl and starts the heartbeat; `close()` stops it.

    `metrics=False` (the nodes other than node 0 of a distributed run): no metrics.jsonl and no wandb; `show`
    prints the progress line and refreshes status.json instead of `log`."""

    def __init__(self, run_dir: Path, total_steps: int, heartbeat_s: float = 15.0, *, metrics: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
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
        self._thread: threading.Thread | None = None
        self._beat_error: BaseException | None = None
        self.heartbeat_failed = threading.Event()  # set when the heartbeat has given up (`check_heartbeat`)

    def start(self) -> None:
        """The reserve first, while the disk has room; then status.json (warmup), metrics.jsonl, the heartbeat.
        Raises NoSpaceError when the disk is full already."""
        self._set_aside()
        if self.metrics:
            with _writing(self.run_dir / METRICS):
                (self.run_dir / METRICS).touch()
        self.set_status(phase="warmup")
        self._thread = threading.Thread(
            target=self._beat, args=(self.heartbeat_s,), name="status-heartbeat", daemon=True
        )
        self._thread.start()

    def write_config(self, config: dict[str, Any]) -> None:
        """train_config.json: the run's whole TrainConfig (atomic: a full disk leaves no partial file)."""
        _atomic_write_text(self.run_dir / TRAIN_CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")

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
        text = json.dumps(self._status, sort_keys=True) + "\n"
        try:
            _atomic_write_text(self.run_dir / STATUS, text)
        except NoSpaceError:
            if self._status["phase"] not in FINAL_PHASES or not self._write_into_reserve(text):
                raise

    def _set_aside(self) -> None:
        """Write the reserve: real blocks (not a sparse file), so that overwriting them needs no new ones."""
        reserve = self.run_dir / STATUS_RESERVE
        try:
            with open(reserve, "wb") as handle:
                handle.write(b" " * (STATUS_RESERVE_BYTES - 1) + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:  # the disk is full already: the status.json write that follows says so
            reserve.unlink(missing_ok=True)

    def _write_into_reserve(self, text: str) -> bool:
        """status.json on a full disk: `text` written over the reserve's blocks, padded with the spaces JSON
        readers skip, then renamed over status.json (which frees the old status.json's blocks: the failure's
        `error:` line can then go to train.log on the same disk). One use: the reserve is gone after it."""
        reserve = self.run_dir / STATUS_RESERVE
        data = text.encode()
        try:
            size = reserve.stat().st_size
            if len(data) > size:
                return False
            with open(reserve, "r+b") as handle:
                handle.write(data.rstrip(b"\n").ljust(size - 1) + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(reserve, self.run_dir / STATUS)
        except OSError:
            return False
        return True

    def _beat(self, interval: float) -> None:
        """Rewrite status.json every `interval` seconds. A write that fails is tried again at the next beat; when
        that fails too, the heartbeat stops and hands its error to the main thread (`check_heartbeat`), which
        ends the run with it (one `error:` line, status.json `failed` through the reserve). Why end the run:
        - the agent and the supervisor read the heartbeat: a stale one makes the supervisor stop the run as
          stalled (SIGTERM, a checkpoint that cannot be written, a misleading reason), so the run would die anyway;
        - a disk that refuses a 1 KiB status file will refuse the next checkpoint: every step from here is lost;
        - one retry, because a full disk is often brief (our own checkpoint writer's partial files, removed when
          it fails; another job's temporary files). Two beats at 15 s leave the heartbeat at most 30 s old, inside
          the 45 s the agent counts as fresh, so a run that recovers never looked dead.
        The thread is a daemon and ends with this: it never keeps the process alive."""
        misses = 0
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    self._write_status()
            except Exception as exc:  # noqa: BLE001 - handed to the main thread, which reports it
                misses += 1
                if isinstance(exc, OSError) and misses < HEARTBEAT_TRIES:
                    continue
                self._beat_error = exc
                self.heartbeat_failed.set()
                return
            misses = 0

    def check_heartbeat(self) -> None:
        """Raise the heartbeat's failure (`_beat`) in the calling thread; the loop calls this every step."""
        if self._beat_error is not None:
            raise self._beat_error

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ---- metrics --------------------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics line, print the progress line, forward to wandb, refresh status."""
        line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
        # Opened per line (a log step is seconds apart): `truncate_metrics` may have replaced the file since.
        with _writing(self.run_dir / METRICS):
            append_whole(self.run_dir / METRICS, line.encode())
        say(progress_line(record, self.total_steps), stream=sys.stdout)  # dropped whole on a full disk
        if self._wandb is not None:
            try:
                self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
            except Exception as exc:  # noqa: BLE001 - wandb must never stop training
                say(f"warning: wandb.log failed ({exc}); disabling wandb")
                self._wandb = None
        self.set_status(step=record["step"])

    def show(self, record: dict[str, Any]) -> None:
        """Print the progress line of a metrics record and refresh status.json, without writing metrics.jsonl."""
        say(progress_line(record, self.total_steps), stream=sys.stdout)
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
                # quiet: no run history and summary block at finish, which came after the trainer's own last
                # lines, so `dflashops logs -n 2` of an ended run showed only wandb's housekeeping (issue 46
                # item 12). Its start lines (where the run's data is saved, offline) stay.
                settings=wandb.Settings(quiet=True),
            )
        except Exception as exc:  # noqa: BLE001
            print(f"warning: wandb.init failed ({exc}); continuing without it", file=sys.stderr)

    def close(self) -> None:
        """Stop the heartbeat, remove the reserve (the run's records are final), finish wandb."""
        self.stop_heartbeat()
        with contextlib.suppress(OSError):
            (self.run_dir / STATUS_RESERVE).unlink(missing_ok=True)
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
        _atomic_write_text(path, "".join(line + "\n" for line in kept))
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
