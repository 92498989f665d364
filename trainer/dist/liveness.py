"""Which node was lost: heartbeats through the rendezvous store, read only after a collective failed.

Every node's background thread bumps a counter `dflash/alive/<rank>` in the job's store (the TCPStore that
torchrun's node-0 agent hosts) every `interval_s`. A collective that fails (gloo: at once when a peer's process
died, since its sockets close; otherwise after --dist-timeout) says neither which node died nor why; so the
survivor reads every counter, waits 2.5 intervals and reads again: a node whose counter did not move is lost.
If the store itself cannot be reached, node 0 (whose torchrun agent hosts it) is gone. Cost in a healthy run:
one small store write per node every interval (1/20 of --dist-timeout, between 0.2 and 5 s). A node that
fails on its own (an error, not a kill) first leaves its error message in the store, and the survivors quote it.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any


def heartbeat_interval(dist_timeout_s: float) -> float:
    return min(5.0, max(0.2, dist_timeout_s / 20))


class Liveness:
    """Heartbeats of this node, and the verdict on the others once something failed."""

    def __init__(self, store: Any, rank: int, nodes: int, interval_s: float) -> None:
        self.store, self.rank, self.nodes, self.interval_s = store, rank, nodes, interval_s
        self._stop = threading.Event()
        self._count = 0
        self._beat()  # the key exists before anyone can ask for it
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(rank: int) -> str:
        return f"dflash/alive/{rank}"

    def _beat(self) -> None:
        self._count += 1
        self.store.set(self._key(self.rank), str(self._count))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (node 0's agent left): nothing left to tell
                return

    def _read(self) -> dict[int, str]:
        return {r: self.store.get(self._key(r)).decode() for r in range(self.nodes) if r != self.rank}

    def lost_nodes(self) -> list[int] | None:
        """The nodes whose heartbeat stopped (possibly none: a link failed or was slow), or None when the store
        cannot be reached at all. Takes about 2.5 heartbeat intervals; bounded by a short store timeout."""
        try:
            self.store.set_timeout(timedelta(seconds=max(2.0, 2 * self.interval_s)))
            before = self._read()
            self._stop.wait(2.5 * self.interval_s)
            after = self._read()
        except Exception:  # noqa: BLE001 - refused, reset or timed out: the store's host is gone
            return None
        return [r for r in sorted(before) if before[r] == after[r]]

    def publish_failure(self, message: str) -> None:
        """Leave this node's error where the survivors look when its collectives stop answering."""
        try:
            self.store.set(f"dflash/failed/{self.rank}", message[:500])
        except Exception:  # noqa: BLE001 - the store is gone too: the survivors will say the node was lost
            pass

    def failure_of(self, rank: int) -> str | None:
        """The error `rank` published before it left, if it did (and the store can still be read)."""
        key = f"dflash/failed/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        self._stop.set()
