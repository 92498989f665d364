"""A disk that fills up outside a checkpoint write (issue 27, item 8), on a REAL full disk: a small tmpfs.

A status.json rewrite, a metrics.jsonl append, the heartbeat's write or the train_config.json write meets a full
disk. The run must end with exit 1 and ONE `error: no space left on <mount> while writing <file>; last good
checkpoint: ...` line plus a `hint:` line, no traceback, no line of train.log cut in the middle (train.log is on
the full disk too, as under the agent's launch wrapper), and status.json `failed` with that error: the final
status write lands in the block set aside at start (`.status.json.reserved`).

Needs root (mount); the tests are skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.full_disk import REPO, SMALL, TRAINER_ENV, fill, needs_root

pytestmark = needs_root

# Never reached: the disk fills long before, and with no checkpoint due the run writes only its records.
ENDLESS = ["--epochs", "10000", "--max-steps", "100000", "--save-interval", "100000"]
PROGRESS = re.compile(
    r"step \d+/100000 \| epoch \d+ \| loss \S+ \| tau_sim \S+ \| lr \S+ \| grad_norm \S+ \| .* eta \S+"
)


def _popen(run: Path, stdout: Any, stderr: Any, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", *SMALL, "--output-dir", str(run), *flags],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env={**os.environ, **TRAINER_ENV},
        cwd=REPO,
    )


def _wait_for_metrics(proc: subprocess.Popen, metrics: Path, lines: int, timeout_s: float = 120.0) -> None:
    """Poll metrics.jsonl until it holds `lines` lines (the run is training), or the process ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_bytes().count(b"\n") >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {lines} metrics lines (exit {proc.poll()})")


def _check_failed_status(run: Path, line: str, pid: int) -> None:
    status = json.loads((run / "status.json").read_text())
    assert (status["phase"], status["exit_code"], status["error"]) == ("failed", 1, line.removeprefix("error: "))
    assert status["pid"] == pid
    with pytest.raises(ProcessLookupError):  # not `training` for a dead pid: the pid is gone and says `failed`
        os.kill(pid, 0)


def test_item8_disk_full_at_a_record_write_mid_run_fails_with_one_error_line(small_disk) -> None:
    """The disk fills while the run trains: the next status.json or metrics.jsonl write fails. train.log is on
    the same full disk (as under the agent's wrapper, which appends the job's stdout and stderr to it)."""
    disk = small_disk(512)
    run = disk / "run"
    run.mkdir()
    log_path = run / "train.log"
    with open(log_path, "ab") as log:
        proc = _popen(run, log, log, *ENDLESS)
    try:
        _wait_for_metrics(proc, run / "metrics.jsonl", 3)
        # Frozen while the filler takes every free block: the run meets a disk that is full, not one that is
        # being filled (whose last free block the filler could take back from the run's failure report).
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            fill(disk)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.endswith("\n"), text[-500:]  # no line cut at the end
    lines = text.splitlines()
    errors = [n for n, line in enumerate(lines) if "error:" in line]  # anywhere: a cut line glued to it shows
    assert len(errors) == 1, text[-3000:]
    line = lines[errors[0]]
    assert re.fullmatch(
        rf"error: no space left on {re.escape(str(disk))} while writing {re.escape(str(run))}/"
        r"(status\.json|metrics\.jsonl); last good checkpoint: none",
        line,
    ), line
    hint = lines[errors[0] + 1]
    assert hint.startswith(f"hint: free space on {disk}, then ") and "the same command" in hint, hint
    cut = [text for text in lines if "step " in text and "/100000 |" in text and not PROGRESS.fullmatch(text)]
    assert cut == [], cut  # every progress line whole
    _check_failed_status(run, line, proc.pid)
    metrics = (run / "metrics.jsonl").read_text()
    assert metrics.endswith("\n") and all(json.loads(text) for text in metrics.splitlines())  # no torn line


def test_item8_disk_full_at_the_train_config_write_fails_with_one_error_line(small_disk) -> None:
    """A disk with room for the status.json reserve and status.json, not for train_config.json."""
    from trainer.state.metrics import STATUS_RESERVE_BYTES

    page = os.sysconf("SC_PAGE_SIZE")  # tmpfs counts whole pages: status.json (~1 KiB) takes one
    disk = small_disk((STATUS_RESERVE_BYTES + page) // 1024)
    run = disk / "run"
    proc = _popen(run, subprocess.PIPE, subprocess.PIPE, "--max-steps", "4")
    out, err = proc.communicate(timeout=120)
    text = out.decode() + err.decode()
    assert proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    line = f"error: no space left on {disk} while writing {run}/train_config.json; last good checkpoint: none"
    lines = err.decode().splitlines()
    assert [text for text in lines if "error:" in text] == [line], text[-3000:]
    assert lines[lines.index(line) + 1].startswith(f"hint: free space on {disk}, then "), text[-3000:]
    _check_failed_status(run, line, proc.pid)
    assert not (run / "train_config.json").exists()  # no partial file left holding space


# ------------------------------------------------------------------ the recorder's writes, one at a time
RECORD = {"epoch": 0, "loss": 2.5, "tau_sim": 1.5, "lr": 1e-3, "grad_norm": 0.5, "block_tok_s": 100.0, "eta_s": 3.0}


def _recorder(disk: Path, heartbeat_s: float = 3600.0) -> Any:
    from trainer.state.metrics import RunRecorder

    run = disk / "run"
    run.mkdir()
    recorder = RunRecorder(run, total_steps=10, heartbeat_s=heartbeat_s)
    recorder.start()
    return recorder


def test_item8_a_heartbeat_that_cannot_write_twice_hands_its_error_to_the_main_thread(small_disk) -> None:
    import threading

    from trainer.core.diskspace import NoSpaceError

    disk = small_disk(64)
    crashed: list[BaseException] = []
    previous_hook, threading.excepthook = threading.excepthook, lambda args: crashed.append(args.exc_value)
    try:
        recorder = _recorder(disk, heartbeat_s=0.01)
        run = recorder.run_dir
        fill(disk)
        assert recorder.heartbeat_failed.wait(timeout=30), "the heartbeat never gave up"
        recorder._thread.join(timeout=30)
        assert not recorder._thread.is_alive() and not crashed, crashed  # ended, not died
        with pytest.raises(NoSpaceError) as raised:
            recorder.check_heartbeat()  # what the loop does every step
        assert str(raised.value) == f"no space left on {disk} while writing {run}/status.json"
        assert not list(run.glob(".status.json.*.tmp")), "a partial status file keeps holding space"
        recorder.set_status(phase="failed", error=str(raised.value), exit_code=1)  # the disk is still full
        status = json.loads((run / "status.json").read_text())
        assert (status["phase"], status["error"]) == ("failed", str(raised.value))
        recorder.close()
    finally:
        threading.excepthook = previous_hook


def test_item8_a_heartbeat_write_that_fails_once_is_tried_again(small_disk, monkeypatch) -> None:
    """A full disk that clears before the next beat (e.g. a failed checkpoint's files removed) ends nothing."""
    import threading

    disk = small_disk(64)
    recorder = _recorder(disk, heartbeat_s=0.01)
    failed_once, freed, beat_again = threading.Event(), threading.Event(), threading.Event()
    write = recorder._write_status

    def observed() -> None:  # the real write; the first failure holds the heartbeat until the space is free
        try:
            write()
        except OSError:
            if not failed_once.is_set():
                failed_once.set()
                freed.wait(timeout=30)
            raise
        if failed_once.is_set():
            beat_again.set()

    monkeypatch.setattr(recorder, "_write_status", observed)
    filler = fill(disk)
    assert failed_once.wait(timeout=30)
    filler.unlink()
    freed.set()
    assert beat_again.wait(timeout=30), "the heartbeat did not write again"
    assert not recorder.heartbeat_failed.is_set() and recorder._thread.is_alive()
    recorder.check_heartbeat()  # nothing to raise
    recorder.close()


def test_item8_a_metrics_line_that_does_not_fit_is_not_written_in_part(small_disk) -> None:
    from trainer.core.diskspace import NoSpaceError

    disk = small_disk(64)
    recorder = _recorder(disk)
    run = recorder.run_dir
    recorder.log({"step": 1, **RECORD})  # metrics.jsonl's block now has room for ~3.8 KiB more
    before = (run / "metrics.jsonl").read_bytes()
    fill(disk)
    with pytest.raises(NoSpaceError) as raised:  # part of the line fits in that block, the rest does not
        recorder.log({"step": 2, **RECORD, "note": "x" * 3 * os.sysconf("SC_PAGE_SIZE")})
    assert str(raised.value) == f"no space left on {disk} while writing {run}/metrics.jsonl"
    assert (run / "metrics.jsonl").read_bytes() == before
    recorder.close()


def test_item8_only_the_final_status_write_uses_the_reserve(small_disk) -> None:
    from trainer.core.diskspace import NoSpaceError
    from trainer.core.run_files import STATUS_RESERVE

    disk = small_disk(64)
    recorder = _recorder(disk)
    run = recorder.run_dir
    fill(disk)
    with pytest.raises(NoSpaceError):  # a run that goes on would need the reserve again: it fails instead
        recorder.set_status(phase="training", step=3)
    assert (run / STATUS_RESERVE).is_file()
    recorder.set_status(phase="failed", error="no space", exit_code=1)
    status = json.loads((run / "status.json").read_text())
    assert (status["phase"], status["step"], status["error"], status["exit_code"]) == ("failed", 3, "no space", 1)
    assert not (run / STATUS_RESERVE).exists()  # used: renamed over status.json
    recorder.close()


def test_item8_say_writes_whole_lines_or_none_on_a_full_disk(small_disk) -> None:
    from trainer.core.lines import say

    disk = small_disk(64)
    log_path = disk / "train.log"
    with open(log_path, "a", encoding="utf-8") as log:
        assert say("first line", stream=log)
        fill(disk)
        assert not say("x" * 3 * os.sysconf("SC_PAGE_SIZE"), "second line", stream=log)  # more than the block holds
        assert say("third line", stream=log)  # what fits in the block still goes in
    assert log_path.read_text() == "first line\nthird line\n"
