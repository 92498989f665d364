"""Is a failed write a full disk? Used by checkpoint writes to turn a library's error into "no space left on X",
and by the run's records (status.json, metrics.jsonl, train_config.json: trainer.state.metrics) to raise `NoSpaceError`.

A full disk does not always surface as `OSError(ENOSPC)`:
  - torch.save (PytorchStreamWriter, C++ iostreams) raises `RuntimeError: [enforce fail at inline_container.cc]
    . unexpected pos N vs M` (or `PytorchStreamWriter failed writing file ...`) with a `basic_ios::clear:
    iostream error` context and no errno at all;
  - safetensors raises `SafetensorError: ... I/O error: No space left on device (os error 28)`.
So `is_out_of_space` looks for the errno (or its text) anywhere in the exception chain, and for torch's
errno-less stream errors asks the filesystem: with less free space than the write needed, the disk was full.
It must be called BEFORE the partial files are removed (removing them frees the space it measures).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
# torch.save's stream writer reports a failed write without an errno (see the module doc).
_STREAM_WRITE_TEXT = ("unexpected pos", "pytorchstreamwriter failed", "iostream error")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception it was raised from or while handling (no cycles)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or any(item is s for s in seen):
            continue
        seen.append(item)
        todo += [item.__cause__, item.__context__]
    return seen


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (statvfs f_bavail)."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds `path` (what `df` names); `path` must exist."""
    path = Path(os.path.realpath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


class NoSpaceError(OSError):
    """A run record could not be written because its filesystem is full: "no space left on MOUNT while writing
    PATH". An OSError (ENOSPC), so code that handles a failed write as an OSError still does."""

    def __init__(self, path: Path, mount: Path) -> None:
        super().__init__(errno.ENOSPC, f"no space left on {mount} while writing {path}")
        self.path, self.mount = path, mount

    def __str__(self) -> str:
        return str(self.strerror)


def as_no_space(exc: BaseException, path: Path | None = None) -> NoSpaceError | None:
    """`exc` as a NoSpaceError when it is a full disk's error for a write of `path` (default: the OSError's own
    `filename`), else None. `path` is the file written, so its folder exists and names the filesystem."""
    if isinstance(exc, NoSpaceError):
        return exc
    if path is None:
        filename = getattr(exc, "filename", None)
        if not isinstance(filename, (str, os.PathLike)):
            return None
        path = Path(filename)
    if not any(isinstance(item, OSError) and item.errno in _NO_SPACE_ERRNOS for item in _chain(exc)):
        return None
    return NoSpaceError(path, mount_point(path.parent))


def is_out_of_space(exc: BaseException, path: Path, needed_bytes: int) -> bool:
    """True when writing `needed_bytes` under `path` failed with `exc` because the filesystem is full."""
    for item in _chain(exc):
        if isinstance(item, OSError) and item.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(item).lower() for text in _NO_SPACE_TEXT):
            return True
    if any(text in str(item).lower() for item in _chain(exc) for text in _STREAM_WRITE_TEXT):
        try:
            return free_bytes(path) < needed_bytes
        except OSError:
            return False
    return False
