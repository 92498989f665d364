"""`tail` and `follow`: reading train.log from a cursor that notices truncation and rotation."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import replace

from .answers import TailAnswer, answer_json
from .common import missing_run, read_int, run_dir
from .protocol import TailRequest

CHECK_BYTES = 64  # the bytes before the cursor that a follower's `check` covers


def verb_tail(req: TailRequest) -> TailAnswer:
    """Bytes of train.log from `offset`, cut at the last newline so no line is split or repeated. `inode`
    (from the previous answer) detects rotation: the rest of the rotated `train.log.1` comes first. `check`
    (also from the previous answer: a digest of the bytes just before `offset`) detects a log that was
    truncated or rewritten in place, and an inode with no `train.log.1` a log replaced by a new file: then
    reading starts again at byte 0 and the answer's `notice` says so, instead of losing or repeating lines.
    `wait_s` (long poll, at most 10 s): when there is nothing new yet, wait here for up to that long, checking
    the file every 50 ms, so a follower sees a line ~50 ms after it is written instead of a poll period later."""
    directory = run_dir(req.workspace, req.name)
    path = os.path.join(directory, "train.log")
    if not os.path.exists(path):
        raise missing_run(req.workspace, req.name, "has no log (it never started here)")
    req = start_of_reading(req, path)
    deadline = time.monotonic() + max(0.0, min(float(req.wait_s or 0), 10.0))
    while True:
        answer = _tail_once(req, directory, path)
        moved = answer.offset != int(req.offset or 0) or answer.inode != req.inode
        if answer.data or answer.finished or moved or answer.notice or time.monotonic() >= deadline:
            return answer
        time.sleep(0.05)


FOLLOW_POLL_S = 0.02  # how often `follow` looks at the file: the floor of its write-to-screen latency
FOLLOW_HEARTBEAT_S = 1.0  # an empty answer this often, so both ends notice a dead link or a gone reader


def verb_follow(req: TailRequest) -> dict:
    """`tail`, streamed: one JSON answer line (the `tail` fields, `ok` true) each time the log moves, starting
    from the request's cursor, until the run has ended and its log is drained; in between an empty answer
    every FOLLOW_HEARTBEAT_S. This is the one verb that prints more than one line. One `pct exec` for a
    whole `logs -f` instead of one per answer: a line reaches the reader ~FOLLOW_POLL_S + half a round trip
    after it is written. A reader that goes away closes the pipe; the next heartbeat's write ends this
    process (BrokenPipeError), so nothing lingers in the container. Returns the last answer (already printed)."""
    directory = run_dir(req.workspace, req.name)
    path = os.path.join(directory, "train.log")
    if not os.path.exists(path):
        raise missing_run(req.workspace, req.name, "has no log (it never started here)")
    req = start_of_reading(req, path)
    cursor = replace(req, offset=int(req.offset or 0))  # the request, its cursor moved past each answer sent
    last_sent = 0.0
    while True:
        answer = _tail_once(cursor, directory, path)
        moved = answer.offset != cursor.offset or answer.inode != cursor.inode
        done = answer.finished and not answer.more and not answer.data and not moved
        now = time.monotonic()
        if answer.data or moved or answer.notice or done or now - last_sent >= FOLLOW_HEARTBEAT_S:
            sys.stdout.write(json.dumps({"ok": True, **answer_json(answer)}) + "\n")
            sys.stdout.flush()
            last_sent = now
            cursor = replace(cursor, offset=answer.offset, inode=answer.inode, check=answer.check)
        if done:
            return {"streamed": True}
        if not (answer.data and answer.more):
            time.sleep(FOLLOW_POLL_S)


def start_of_reading(req: TailRequest, path: str) -> TailRequest:
    """A reader's first request, moved to a line start: `lines` N starts at the last N lines of train.log
    (`logs -n N`); `align` moves an `offset` inside a line (`logs --since N` typed by hand) forward to the start
    of the next line, so no line is shown from its middle. Later requests carry neither: their offsets are the
    answers' own, which may be inside a line longer than one answer."""
    if req.lines is None and not req.align:
        return req
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if req.lines is not None:
            offset = last_lines_start(handle, size, int(req.lines))
        else:
            offset = int(req.offset or 0)
            if 0 < offset <= size:
                offset = next_line_start(handle, offset, size)
    return replace(req, offset=offset, check=None, lines=None, align=False)


def last_lines_start(handle, size: int, lines: int) -> int:
    """The offset where the last `lines` lines of the file start (a last line without its newline counts)."""
    if lines <= 0 or size == 0:
        return size
    handle.seek(size - 1)
    end = size - 1 if handle.read(1) == b"\n" else size  # the newline that ends the last line starts nothing
    found, pos = 0, end
    while pos > 0:
        start = max(0, pos - 65536)
        handle.seek(start)
        block = handle.read(pos - start)
        index = len(block)
        while (index := block.rfind(b"\n", 0, index)) >= 0:
            found += 1
            if found == lines:
                return start + index + 1
        pos = start
    return 0


def next_line_start(handle, offset: int, size: int) -> int:
    """`offset` when a line starts there, else the start of the next line (the end of the file if none)."""
    handle.seek(offset - 1)
    if handle.read(1) == b"\n":
        return offset
    while offset < size:
        block = handle.read(65536)
        if (index := block.find(b"\n")) >= 0:
            return offset + index + 1
        offset += len(block)
    return size


def prefix_check(handle, offset: int) -> str:
    """Digest of the CHECK_BYTES bytes before `offset` ("" at 0)."""
    if offset <= 0:
        return ""
    handle.seek(max(0, offset - CHECK_BYTES))
    return hashlib.sha1(handle.read(min(offset, CHECK_BYTES))).hexdigest()[:16]


def utf8_whole(data: bytes) -> bytes:
    """`data` without a trailing incomplete UTF-8 sequence, so a piece of a long line never ends inside a
    character (the rest comes with the next piece)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead byte
            continue
        need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
        return data[:-back] if need > back else data
    return data


def _tail_once(req: TailRequest, directory: str, path: str) -> TailAnswer:
    offset, inode = int(req.offset or 0), req.inode
    max_bytes = 1 << 20 if req.max_bytes is None else int(req.max_bytes)
    current_inode = os.stat(path).st_ino
    source, rotated, notice = path, False, None
    if inode is not None and int(inode) != current_inode:
        old = path + ".1"
        if os.path.exists(old) and os.stat(old).st_ino == int(inode):
            source, rotated = old, True
        else:
            offset, notice = 0, "train.log was replaced by a new file; reading the new one from its start"
    with open(source, "rb") as handle:
        expected = req.check
        if notice is None and (
            offset > os.fstat(handle.fileno()).st_size
            or (expected is not None and prefix_check(handle, offset) != expected)
        ):
            offset, notice = 0, "train.log was truncated or rewritten; reading it again from its start"
        handle.seek(offset)
        data = handle.read(max_bytes)
        at_end = handle.read(1) == b""
        finished = read_int(os.path.join(directory, "exit_code")) is not None
        if at_end and (rotated or finished):
            pass  # the file is complete: deliver everything, including a last line without a newline
        elif b"\n" in data:
            data = data[: data.rfind(b"\n") + 1]  # keep a partial last line for the next call
        elif len(data) < max_bytes:
            data = b""
        else:
            data = utf8_whole(data)  # a line longer than max_bytes: deliver it in pieces, whole characters
        next_offset = offset + len(data)
        check = prefix_check(handle, next_offset)
    if rotated and at_end:
        next_offset, check, source = 0, "", path
    return TailAnswer(
        data=data.decode("utf-8", errors="replace"),
        offset=next_offset,
        inode=os.stat(source).st_ino,
        check=check,
        finished=finished,
        notice=notice,
        more=not at_end or rotated,
    )
