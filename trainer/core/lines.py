"""Appending lines whole or not at all, also on a full disk: metrics.jsonl and train.log (stdout, stderr).

A write that meets a full disk lands in part: the bytes that fit in the file's last block, then ENOSPC. `print`
then leaves a line cut in the middle, and the next line that fits is glued to it (a traceback cut mid-line was
the symptom of issue 27, item 8). Here a line is written with one `os.write` per attempt, and when only part of
it landed, the file is truncated back to where it started: shrinking a file needs no free block.

The job's stdout and stderr are appended to train.log in the run directory (the agent's launch wrapper), on the
disk that the run fills; `say` writes there and never raises: a line that does not fit is dropped whole (it
returns False), since the run's records (status.json, metrics.jsonl) are what report the full disk. The failure
report frees a block first, so its `error:` line usually fits (trainer.state.failure).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import TextIO

# One `say` at a time in this process: the truncation that takes a partial line back must not take another
# thread's line with it. (Another process appending to the same file at that instant could still lose a line:
# the agent's own `dflashops: ...` lines are written when the job starts and after it ends, not while it fails.)
_lock = threading.Lock()


def write_whole(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`; on an error (ENOSPC), take back what landed, then raise it."""
    written = 0
    try:
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError:
        if written:
            _take_back(fd, written)
        raise


def _take_back(fd: int, count: int) -> None:
    """Remove the last `count` bytes this descriptor wrote (a partial line). With O_APPEND and without, the file
    offset is the end of what was just written."""
    try:
        end = os.lseek(fd, 0, os.SEEK_CUR)
        os.ftruncate(fd, end - count)
        os.lseek(fd, end - count, os.SEEK_SET)  # for a descriptor without O_APPEND: the next write starts there
    except OSError:
        pass  # not a regular file (a pipe): its reader has the bytes, and a pipe is never full for good


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` (created if missing), whole or not at all; raises the write's error."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        write_whole(fd, data)
    finally:
        os.close(fd)


def say(*lines: str, stream: TextIO | None = None) -> bool:
    """Write `lines` (each without its newline) to `stream` (default stderr) whole or not at all. Never raises;
    False when they could not be written (a full disk)."""
    target = sys.stderr if stream is None else stream
    text = "".join(line + "\n" for line in lines)
    with _lock:
        try:
            target.flush()  # what `print` left in the stream's buffer comes first
        except (OSError, ValueError):
            pass
        try:
            fd = target.fileno()
        except (OSError, ValueError):  # no descriptor (io.UnsupportedOperation: a test's capture): as `print`
            try:
                target.write(text)
                target.flush()
                return True
            except (OSError, ValueError):
                return False
        try:
            write_whole(fd, text.encode(getattr(target, "encoding", None) or "utf-8", "backslashreplace"))
            return True
        except OSError:
            return False
