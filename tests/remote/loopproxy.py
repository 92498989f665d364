"""A loopback TCP proxy for fault tests: added latency, stalls, and cuts mid-transfer (127.0.0.1 only).

    proxy = LoopProxy(upstream_port=sshd_port).start()
    proxy.latency_s = 0.025          # each direction: 50 ms added round trip
    proxy.cut_after(upstream_bytes=200_000)   # close every connection once that many more bytes went up
    proxy.cut_after_down(downstream_bytes=4_000_000)  # ... or came down (a download cut halfway)
    proxy.stall()/proxy.resume()     # hold traffic without closing (a hung network)
    proxy.cut_all()                  # close every live connection now
    proxy.refuse = True              # new connections are accepted and closed at once (host "down")

Each connection gets one forwarding thread per direction. Latency is applied per chunk with a release
time (arrival + latency), so bandwidth is kept and only the delay is added, as on a long link.
Counters (`bytes_up`, `bytes_down`) let benchmarks measure what a sync really sent.
"""

from __future__ import annotations

import collections
import socket
import threading
import time


class LoopProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.latency_s = 0.0
        self.refuse = False
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections_cut = 0
        self.connections_accepted = 0  # TCP connections made through the proxy (ssh connections opened)
        self._cut_budget: int | None = None
        self._down_budget: int | None = None
        self.bytes_down_at_cut: int | None = None  # bytes_down when the last cut_after_down fired
        self._running = threading.Event()
        self._running.set()
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = False

    def start(self) -> LoopProxy:
        threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}", daemon=True).start()
        return self

    # -- controls ----------------------------------------------------------------------------------
    def cut_after(self, upstream_bytes: int) -> None:
        """Cut every live connection once `upstream_bytes` more bytes went client -> server."""
        with self._lock:
            self._cut_budget = upstream_bytes

    def cut_after_down(self, downstream_bytes: int) -> None:
        """Cut every live connection once `downstream_bytes` more bytes went server -> client."""
        with self._lock:
            self._down_budget = downstream_bytes

    def cut_all(self) -> None:
        with self._lock:
            live, self._live = list(self._live), set()
            self._cut_budget = None
            if live:
                self.connections_cut += 1
        for sock in live:
            _hard_close(sock)

    def stall(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_up = self.bytes_down = 0

    def close(self) -> None:
        self._closed = True
        self.resume()
        self.cut_all()
        self._listener.close()

    # -- forwarding --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse:
                _hard_close(client)
                continue
            self.connections_accepted += 1
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _hard_close(client)
                continue
            with self._lock:
                self._live.update((client, server))
            for src, dst, upward in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, upward), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        pending: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()
        done = threading.Event()

        def sender() -> None:
            while True:
                with ready:
                    while not pending and not done.is_set():
                        ready.wait(0.1)
                    if not pending and done.is_set():
                        break
                    due, chunk = pending.popleft()
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self._running.wait()
                try:
                    dst.sendall(chunk)
                except OSError:
                    break
            _shutdown(dst)

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        while True:
            self._running.wait()
            try:
                chunk = src.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            if self._account(len(chunk), upward):
                break
            with ready:
                pending.append((time.monotonic() + self.latency_s, chunk))
                ready.notify()
        done.set()

    def _account(self, size: int, upward: bool) -> bool:
        """Count bytes; True when a pending cut fired (all connections closed)."""
        with self._lock:
            if upward:
                self.bytes_up += size
            else:
                self.bytes_down += size
            fire = False
            if upward and self._cut_budget is not None:
                self._cut_budget -= size
                fire = self._cut_budget <= 0
            if not upward and self._down_budget is not None:
                self._down_budget -= size
                if self._down_budget <= 0:
                    fire, self._down_budget, self.bytes_down_at_cut = True, None, self.bytes_down
        if fire:
            self.cut_all()
        return fire


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _hard_close(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped link looks to the peer, not a polite FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
