"""Worker processes that end with the process that started them.

A `ProcessPoolExecutor` worker (prepare's regeneration workers, trainer/evaluation/eval_workers.py) outlives a
parent that is killed alone (SIGKILL to its pid, the OOM killer): it waits on its task queue forever, holding a
copy of the target (540 MB for SmolLM2), and so does the pool's resource tracker (measured 2026-12-07 with a
spawned pool of two: both workers still there 55 s after their parent's SIGKILL). A signal to the whole process
group (Ctrl-C, `dflashops stop`) reaches them anyway; this is for the parent that dies alone.

`end_with_parent(parent)` in a worker's initializer: a daemon thread that ends the worker once its parent is gone
(its parent pid changes, as the kernel re-parents an orphan). It checks once a second: one wake-up a second is
nothing next to a model's forward, and a worker outlives its parent by at most that.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 1.0


def end_with_parent(parent: int, poll_s: float = POLL_S) -> None:
    """End this process (exit status 1, no cleanup: it holds nothing to save) once `parent` is no longer its parent;
    at once when it already is not (the parent died before the worker got here)."""
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()
