"""The one training loop: resume, log window, checkpoint schedule, stop and failure handling, for every engine.

`run_training(setup, engine)` reads top to bottom like torchtitan's Trainer.train:
  1. run directory; inside the stop handler (SIGTERM/SIGHUP/SIGINT, installed before the minutes-long target
     load): status.json (warmup, and its reserve for a full disk), train_config.json, the engine's start lines
  2. wandb, engine.build() (targets, drafters), engine.warm_up() (compiles for the batch shapes ahead: it needs
     no weights, so a restart's warm-up runs while the stopped run still writes the checkpoint), resume (model,
     optimizer, schedule, RNG, data position)
  3. engine.running(): worker threads (and what warm-up is left); then per optimizer step:
     train_step -> after_step (replica checks) -> agree_stop (one collective across nodes) -> log line every
     --log-interval -> checkpoint every --save-interval (and at the end and on a stop) -> stop
  4. the final checkpoint (end of run, stop request) is written after the worker threads stop; on a stop the
     devices are released first and status.json offers the hand-over (trainer.state.handover), so a restart can
     start the next run while the write goes on
  5. exit 0 done, 1 failed (status.json `failed`; trainer.state.failure), 128+signum stopped with a checkpoint
A full disk at a record's write (status.json, metrics.jsonl, train_config.json) raises NoSpaceError, and a
heartbeat that could not write is raised at the next step (RunRecorder.check_heartbeat): one `error:` line.
The engine (trainer.training.engine.Engine: single-process, threaded pipeline, distributed) owns how a step is computed
and what its metrics line holds; the loop owns when things happen. The loop imports no engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.core import compile_cache
from trainer.core.lines import say
from trainer.core.signals import GracefulStop
from trainer.state.checkpoint import CheckpointWriter, check_shapes, checkpoint_dir, read_state
from trainer.state.failure import record_failure
from trainer.state.handover import (
    check_handed_over,
    commit_when_durable,
    devices_free,
    offered_start,
    read_handed_over,
    wait_for_checkpoint,
)
from trainer.state.metrics import RunRecorder, truncate_metrics
from trainer.training.engine import Engine
from trainer.training.preflight import RunSetup, check_resume_nodes, expected_shapes

# Tests: each optimizer step takes at least this many seconds. A tiny run on the CPU trains ~50 steps/s and keeps
# a core busy while its test waits on something else (a restart, a standby, a gate); on a 2-core machine running
# two test workers, a few such runs were a third of the suite's CPU time. Paced, the run is the same run, slower.
MIN_STEP_ENV = "TRAINER_TEST_MIN_STEP_S"

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def log(message: str) -> None:
    say(message)  # whole or not at all: train.log may be on a full disk (trainer.core.lines)


def drafter_line(config: Any) -> str:
    """`drafter: DFlash2, 2 layers, block 8, taps 0,1 of the target`: which drafter the run trains, named in its
    log (a DFlash2 run's log never said its architecture; issue 46 item 12)."""
    name = {"dflash": "DFlash", "dflash2": "DFlash2"}.get(config.arch, config.arch)
    taps = ",".join(str(i) for i in config.target_layer_ids)
    return f"drafter: {name}, {config.num_hidden_layers} layers, block {config.block_size}, taps {taps} of the target"


def run_training(setup: RunSetup, engine: Engine) -> int:
    """Train `setup` with `engine`; return the exit code (see module doc). Everything that can refuse the run has
    been checked already (trainer.training.preflight and the engine's constructor): from here on the run directory exists."""
    cfg = setup.cfg
    run_dir = Path(cfg.output_dir or ".")
    run_dir.mkdir(parents=True, exist_ok=True)
    recorder = RunRecorder(run_dir, engine.total_steps, metrics=engine.writes_metrics)
    on_force = lambda signum: recorder.set_status(  # noqa: E731 - a second signal: no checkpoint
        phase="failed", error=f"second signal {signum}: exited without a checkpoint", exit_code=128 + signum
    )
    writer: CheckpointWriter | None = None  # read by the failure report: a write that failed meanwhile
    failure: BaseException | None = None
    # Installed before the (possibly minutes long) target load, so a stop request is never lost.
    with GracefulStop(on_force=on_force) as stop:
        try:
            recorder.start()  # a full disk from here on is the failure report's, with status.json `failed`
            recorder.write_config(cfg.to_dict())
            recorder.mark("preflight_done")
            for line in engine.announce(run_dir):
                log(line)
            binds, why = step_limit(cfg, engine.total_steps)
            recorder.set_status(step_limit=binds)
            log(why)
            log(drafter_line(setup.drafter_config))
            if engine.writes_metrics:
                recorder.open_wandb(cfg.wandb, cfg.wandb_project, cfg.wandb_run_name, cfg.to_dict())
            engine.build()
            recorder.mark("built")
            cache = compile_cache.choose(setup.drafter_device)  # shared by code versions: content-addressed
            if cache is not None and not any(cache.iterdir()) and (loaded := compile_cache.load_artifacts(cache, log)):
                log(f"compile cache {cache}: started from {loaded} bytes of artifacts of an earlier run")
            cache_report = CacheReport(cache, recorder, engine.writes_checkpoints) if cache is not None else None
            start = start_point(setup)
            if start is not None:
                engine.warm_up(*start, recorder)
                recorder.mark("compiled")
            if cache_report is not None:
                cache_report.update()
            step = _resume(setup, engine, recorder, run_dir)
            # The writer exits before the failure report: a checkpoint snapshotted before a failure still lands.
            with CheckpointWriter(run_dir, cfg.keep_checkpoints) as writer:
                with engine.running(step, recorder):
                    ending = _steps(
                        setup, engine, recorder, writer, stop, step, cache_report.update if cache_report else None
                    )
                if cache_report is not None:
                    cache_report.update()
                if ending.phase == "stopped" and writer.in_flight():
                    _offer_handover(engine, recorder, run_dir, ending)
                report_checkpoints(recorder, writer.wait())  # the final checkpoint: waited for, never cut short
            recorder.mark("ended")
            recorder.set_status(phase=ending.phase, step=ending.step, exit_code=ending.code)
            if ending.phase == "stopped" and ending.trained:
                log(f"stopped at step {ending.step}; {resume_advice()}")
            return ending.code
        except Exception as exc:  # noqa: BLE001 - reported on stderr and in status.json
            failure = exc
            record_failure(
                recorder,
                exc,
                run_dir=run_dir,
                writer=writer,
                keep_checkpoints=cfg.keep_checkpoints,
                exit_code=EXIT_FAILED,
            )
            return EXIT_FAILED
        finally:
            engine.close(failure)
            recorder.close()


def step_limit(cfg: Any, total_steps: int) -> tuple[str, str]:
    """Which limit ends the run, and one log line saying so: ("max_steps" | "epochs", line). The run trains
    min(--max-steps, the steps the data holds over --epochs); `-- --max-steps 5000` on the tiny preset trained
    3200 (its `epochs` hold 3200) and nothing said which limit won (issue 46 item 4). status.json's `step_limit`
    carries the answer to `dflashops status`, which shows it beside the eta."""
    max_steps = int(cfg.max_steps or 0)
    if max_steps and total_steps >= max_steps:
        return "max_steps", f"{total_steps} steps: --max-steps {max_steps} ends the run (before --epochs {cfg.epochs})"
    capped = f"; --max-steps {max_steps} is never reached: raise --epochs to reach it" if max_steps else ""
    return "epochs", (
        f"{total_steps} steps: --epochs {cfg.epochs} ends the run (the data gives {total_steps} optimizer steps "
        f"over {cfg.epochs} epoch{'' if cfg.epochs == 1 else 's'}{capped})"
    )


def resume_advice() -> str:
    """How to go on from a stopped run: the same command for a trainer started by hand (it resumes from its
    output directory's newest checkpoint); for a run dflashops launched (DFLASHOPS_RUN_NAME set), its own restart
    verb, which the same command would not be (it makes a new run directory)."""
    run_name = os.environ.get("DFLASHOPS_RUN_NAME")
    if run_name:
        return f"resume with: dflashops restart {run_name} --resume"
    return "resume with the same command"


def start_point(setup: RunSetup) -> tuple[int, tuple[int, int]] | None:
    """(step, (epoch, index)) this run continues from, as far as it is known before the checkpoint is read: the
    beginning, the --resume checkpoint's state.json, or, while the stopped run still writes it, that run's
    hand-over offer (trainer.state.handover); None when none of these says it, and on a node that reads no
    checkpoints (a distributed run's nodes other than node 0: the checkpoint is on node 0's disk)."""
    if not setup.reads_checkpoints:
        return None
    if setup.resume_from is None:
        return 0, (0, 0)
    if setup.resume_writer is None:
        state = read_state(setup.resume_from)
        return int(state["step"]), (int(state["epoch"]), int(state["index"]))
    return offered_start(setup.resume_writer, setup.resume_from)


def _resume(setup: RunSetup, engine: Engine, recorder: RunRecorder, run_dir: Path) -> int:
    """Restore the checkpoint the setup names (if any) into the engine; return the first step to train."""
    if setup.resume_from is None:
        return 0
    source = setup.resume_from
    if setup.resume_writer is not None:  # the stopped run is still writing it (trainer.state.handover)
        log(f"waiting for {setup.resume_writer.name} to finish writing {setup.resume_from}")
        recorder.set_status(waiting_for=str(setup.resume_from))
        source = wait_for_checkpoint(setup.resume_from, setup.resume_writer)

        def deferred_checks(checkpoint: Path) -> None:  # the pre-flight's checks of a checkpoint not yet there
            check_shapes(checkpoint, expected_shapes(setup.drafter_config))
            check_resume_nodes(checkpoint, setup.cfg.nodes)

        source = check_handed_over(deferred_checks, source, setup.resume_from, setup.resume_writer)
        recorder.set_status(waiting_for=None)
        recorder.mark("checkpoint_ready")
    if setup.resume_writer is None:
        state = engine.load_checkpoint(source)
    else:
        state = read_handed_over(engine.load_checkpoint, source, setup.resume_from, setup.resume_writer)
        recorder.mark("checkpoint_read")
        # Read through the page cache while the writer's fsyncs ran; resumed only once it is durable.
        committed = commit_when_durable(setup.resume_from, setup.resume_writer, source)
        if committed:
            log(committed)
    step, position = engine.restore(state)
    dropped = truncate_metrics(run_dir, step)
    # status.json first: whoever reads "resumed from" in the log and then the status sees the resumed step and
    # checkpoint there (a test that did so under load read the old status: CI, 2026-12-07).
    if engine.writes_checkpoints:
        recorder.set_status(step=step, last_checkpoint=str(setup.resume_from))
    else:
        recorder.set_status(step=step)
    log(
        f"resumed from {setup.resume_from} at step {step} ({position}"
        f"{f'; dropped {dropped} metrics lines past it' if dropped else ''})"
    )
    if change := schedule_change(setup.cfg, state, step, engine.total_steps):
        log(change)
    recorder.mark("resumed")
    return step


# The flags that shape the optimizer's schedule and step size: a resume takes them from this run
# (trainer.training.step.apply_run_hyperparameters), so a change gets one log line.
SCHEDULE_FLAGS = ("max_steps", "lr", "warmup_ratio", "weight_decay")


def schedule_change(cfg: Any, state: Any, step: int, total_steps: int) -> str | None:
    """A resume whose --max-steps, --lr, --warmup-ratio or --weight-decay differ from the checkpoint's run trains
    on this run's values from the resumed step on (the LR schedule, warmup then cosine to 0 at the last step,
    recomputed over this run's length and peak LR), so the LR may jump there: one line names each changed flag
    with the checkpoint's value, and the LR at the resumed step under the old schedule and the new one. None when
    none changed (or the checkpoint records no config)."""
    from trainer.training.step import lr_factor

    config = (getattr(state, "extra", None) or {}).get("config") or {}
    changed = [flag for flag in SCHEDULE_FLAGS if flag in config and config[flag] != getattr(cfg, flag)]
    if not changed:
        return None

    def shown(value: Any) -> str:
        return "none" if value is None else f"{value:g}"

    flags = ", ".join(
        f"--{flag.replace('_', '-')} {shown(getattr(cfg, flag))} (the checkpoint's run had {shown(config[flag])})"
        for flag in changed
    )
    last_lr = ((getattr(state, "scheduler", None) or {}).get("_last_lr") or [None])[0]
    new_lr = cfg.lr * lr_factor(step, total_steps, cfg.warmup_ratio)
    was = f"{last_lr:.3g} -> " if isinstance(last_lr, (int, float)) else ""
    return (
        f"{flags}: the learning-rate schedule is recomputed to end at step {total_steps} (warmup, then cosine to 0 "
        f"there); LR at step {step}: {was}{new_lr:.3g}"
    )


class CacheReport:
    """status.json's `compile_cache` counters, and the artifacts saved for other machines, kept true as the run
    compiles. Not only after the warm-up: what a warm-up does not cover (a target compiled at its first call, as
    `--target-compile on` on the CPU, whose warm-up compiles nothing) compiles in the first step, and a report
    taken before it read 0 hits and 0 misses in runs that reused the cache. Updated after the warm-up, after the
    first step, and at the end of the steps; artifacts are saved whenever new work was compiled since the last
    save (torch saves what this process used so far, hits and new work)."""

    def __init__(self, cache: Path, recorder: RunRecorder, saves: bool) -> None:
        self.cache, self.recorder, self.saves = cache, recorder, saves
        self.logged: dict[str, int] = {}
        self.saved_misses = 0

    def update(self) -> None:
        counts = compile_cache.stats()
        if counts == self.logged:
            return
        self.recorder.set_status(compile_cache={"dir": str(self.cache), **counts, **compile_cache.settings_digest()})
        if counts["fxgraph_hit"] or counts["fxgraph_miss"]:
            log(compile_cache.describe(self.cache, counts))
        self.logged = counts
        if self.saves and counts["fxgraph_miss"] > self.saved_misses:  # new work: carry it to other machines
            compile_cache.save_artifacts(self.cache)
            self.saved_misses = counts["fxgraph_miss"]


@dataclass
class Ending:
    """How the steps ended: the exit code, the last step trained, the final status phase (done | stopped)."""

    code: int
    step: int
    phase: str
    trained: bool = True  # False: stopped before the first step of this process
    position: tuple[int, int] | None = None  # (epoch, index) of the last checkpoint's next micro-batch


def _steps(
    setup: RunSetup,
    engine: Engine,
    recorder: RunRecorder,
    writer: CheckpointWriter,
    stop: GracefulStop,
    step: int,
    after_first_step: Callable[[], None] | None = None,
) -> Ending:
    """The optimizer steps from `step` on. The last checkpoint (end of run, stop) is submitted, not waited
    for: the caller waits once the worker threads have stopped (and, on a stop, the devices are free).
    `after_first_step` runs once this process's first step is done (what compiles only there has compiled)."""
    cfg, total_steps = setup.cfg, engine.total_steps
    signum = engine.agree_stop(stop.signum)
    if signum is not None:  # signalled while loading: nothing trained since the last checkpoint (if any)
        engine.finish()
        return Ending(128 + signum, step, "stopped", trained=False)
    recorder.mark("warmed_up")
    first = step
    position: tuple[int, int] | None = None
    min_step_s = float(os.environ.get(MIN_STEP_ENV) or 0.0)
    while step < total_steps:
        started = time.monotonic()
        engine.train_step(step)
        if (left := min_step_s - (time.monotonic() - started)) > 0 and stop.signum is None:
            time.sleep(left)
        recorder.check_heartbeat()  # a status.json the heartbeat could not write ends the run (RunRecorder._beat)
        step += 1
        if step == first + 1:
            recorder.mark("first_step")
            layout = engine.checkpoint_layout()  # the optimizer's state exists now: pin the snapshot buffers
            if layout is not None:
                writer.prepare(layout)
            if after_first_step is not None:
                after_first_step()
        extra = engine.after_step(step)  # e.g. replica checksums, which also force a log line
        signum = engine.agree_stop(stop.signum)  # every node stops after the same step
        stopping = signum is not None
        last = step == total_steps or stopping
        if stopping:
            recorder.mark("stop_agreed")
        if step % cfg.log_interval == 0 or last or extra:
            record = engine.record(step)
            record.update(extra or {})
            if engine.writes_metrics:
                recorder.log(record)
            else:
                recorder.show(record)
        if step % cfg.save_interval == 0 or last:
            parts = engine.checkpoint_parts(step)  # a collective under --sync average across nodes
            if parts is not None:
                save_in_background(recorder, writer, step, parts, last=last)
                position = (int(parts["epoch"]), int(parts["index"]))
        else:
            report_checkpoints(recorder, writer.poll())  # a lock, no I/O: also raises a failed write here
        if stopping:
            assert signum is not None
            engine.finish()
            return Ending(128 + signum, step, "stopped", position=position)
    engine.finish()
    return Ending(EXIT_OK, step, "done")


def _offer_handover(engine: Engine, recorder: RunRecorder, run_dir: Path, ending: Ending) -> None:
    """The final checkpoint of a stop is in host memory and still being written: drop every device tensor,
    and if the devices are free say so in status.json, so a restart may start the next run beside this
    process (trainer.state.handover). Memory still held (references this engine does not know of) means no offer:
    the restart then waits for this process to exit, as without the hand-over."""
    started = time.monotonic()
    left = engine.release_devices()
    recorder.mark("devices_released")
    if not devices_free(left):
        log(
            f"devices still hold {', '.join(f'{d} {b / 2**30:.1f} GiB' for d, b in left.items())} after the "
            "release: no hand-over"
        )
        return
    target = checkpoint_dir(run_dir, ending.step)
    recorder.set_status(
        handover={
            "checkpoint": str(target),
            "step": ending.step,
            "position": list(ending.position) if ending.position else None,  # the next run warms up from here
            "devices_released": True,
            "device_bytes_left": left,
            "release_s": round(time.monotonic() - started, 3),
        }
    )


def save_in_background(
    recorder: RunRecorder, writer: CheckpointWriter, step: int, parts: dict[str, Any], *, last: bool
) -> None:
    """Checkpoint `step` (`parts`: what `snapshot_checkpoint` takes) and report what has landed. Training waits
    only for the snapshot (device->host copy; status phase "saving" meanwhile); the write overlaps the next
    steps. The `last` checkpoint of this process (end of run, stop request) is only submitted here: the phase
    stays "saving" and run_training waits for it before the process ends (never exit half written)."""
    recorder.set_status(phase="saving", step=step)
    writer.submit(writer.snapshot(step, **parts))
    if last:
        recorder.mark("final_snapshot")
        return
    report_checkpoints(recorder, writer.poll())
    recorder.set_status(phase="training")


def report_checkpoints(recorder: RunRecorder, paths: list[Path]) -> None:
    """Log each checkpoint that has landed and make the newest the run's `last_checkpoint`."""
    for path in paths:
        log(f"checkpoint {path}")
        recorder.set_status(last_checkpoint=str(path))
