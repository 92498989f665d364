"""The `ssh` transport: Fabric for connecting (ssh_config, gateways), raw paramiko channels for running.

Contract:
- One connection per transport instance (= per CLI invocation), opened on first use and reused by every
  command; if it dropped (cut link, sshd restart) the next command reconnects once, transparently. A
  command in flight when the link drops raises `TransportError` (never retried here: it may not be
  idempotent; callers that can resume, such as `logs -f` with its byte offset, retry themselves).
- Host keys are checked against known_hosts (the inventory's file, else ~/.ssh/known_hosts) and an
  unknown key is REFUSED with its SHA256 fingerprint and a `dflashops trust HOST` hint (Fabric's own
  default auto-adds any key). A changed key is refused too.
- ~/.ssh/config is honoured through Fabric (aliases, User, Port, IdentityFile, ProxyJump, ConnectTimeout);
  `$DFLASHOPS_SSH_CONFIG` points at another file (tests use it). Inventory values win over ssh_config.
- stdin is written on the raw channel from a thread (binary-safe: Fabric's `in_stream` decodes text byte
  by byte) while stdout/stderr are drained, so a command that talks back while reading cannot deadlock.
- A channel the server refuses (sshd's MaxSessions) fails that command only; the connection stays up for the
  others (a multiplexer's one connection carries every invocation's commands).
- Every paramiko/socket failure becomes a one-line `TransportError` with a hint; paramiko's own logging is
  silenced unless DFLASHOPS_DEBUG is set (its "Exception (client)" tracebacks would reach the terminal).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import fabric
import paramiko

from dflashops.core.errors import TransportError
from dflashops.core.shell import env_argv, join_argv
from dflashops.transport.base import StderrSink, Stdin, Transport
from dflashops.transport.ssh_connect import CLOSED_HERE, ENDED_BY, build_connection
from dflashops.transport.ssh_keys import check_identity_files, translate_connect_error
from dflashops.transport.ssh_settings import SshSettings, settings_for_host

__all__ = ["SshSettings", "SshTransport", "build_connection", "settings_for_host"]

if not os.environ.get("DFLASHOPS_DEBUG"):
    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    logging.getLogger("paramiko").propagate = False

CHUNK = 64 * 1024
LOCAL_CLOSE = "closed on this side"
# With no byte from the server for this long, a keepalive with reply is sent; no reply within
# PROBE_TIMEOUT_S means the link is dead (paramiko's own keepalive never notices a silent peer).
IDLE_PROBE_S = 15.0
PROBE_TIMEOUT_S = 10.0
# paramiko starts a key re-exchange after every 512 MiB (2^29 bytes); here one that began next to a channel
# closing stalled the link for paramiko's 30 s key-exchange timeout now and then (seen during 1 GB fetches).
# RFC 4344 allows 2^32 blocks per key for AES (64 GiB, OpenSSH's own default): 16 GiB keeps 4x margin.
REKEY_BYTES = 1 << 34


@dataclass
class SshTransport(Transport):
    """Runs argv on a host over one reused SSH connection (see the module docstring)."""

    settings: SshSettings | None = None
    _conn: fabric.Connection | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.settings is None:
            raise ValueError("SshTransport needs settings")

    # -- connection ---------------------------------------------------------------------------------
    def connection(self) -> paramiko.Transport:
        """The live paramiko Transport, connecting (or reconnecting after a drop) when needed."""
        with self._lock:
            if self._conn is not None and self._conn.transport is not None and self._conn.transport.is_active():
                return self._conn.transport
            self._close_quietly()
            settings = self.settings
            assert settings is not None
            check_identity_files(settings)
            conn = build_connection(settings)
            try:
                conn.open()
            except Exception as exc:  # noqa: BLE001 - every failure mode of connect becomes one TransportError
                self._conn = conn
                self._close_quietly()
                raise translate_connect_error(exc, settings, conn) from None
            assert conn.transport is not None
            conn.transport.set_keepalive(settings.keepalive_s)
            conn.transport.packetizer.REKEY_BYTES = REKEY_BYTES
            self._conn = conn
            return conn.transport

    @property
    def connected(self) -> bool:
        """True while this transport holds a live connection (it connected, and the link has not dropped)."""
        conn = self._conn
        return conn is not None and conn.transport is not None and conn.transport.is_active()

    def close(self, why: str = LOCAL_CLOSE) -> None:
        """Drop the connection; `why` is what a command still running on it reports as the link's cause."""
        with self._lock:
            self._close_quietly(why)

    def _close_quietly(self, why: str = LOCAL_CLOSE) -> None:
        if self._conn is not None:
            mark_closed_here(self._conn.transport, why)
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - closing a broken link may raise anything
                pass
            self._conn = None

    # -- commands -----------------------------------------------------------------------------------
    def command_line(self, argv: Sequence[str], env: Mapping[str, str]) -> str:
        return join_argv([*env_argv(env), *argv] if env else list(argv))

    def _open_channel(self, argv: Sequence[str], env: Mapping[str, str]) -> paramiko.Channel:
        transport = self.connection()
        try:
            channel = transport.open_session(timeout=self.settings.connect_timeout if self.settings else None)
        except paramiko.ChannelException as exc:
            # The server answered and refused this one channel (sshd's MaxSessions, 10 by default, counts the
            # channels of one connection): the link is fine. Closing it would end every other command on it,
            # and a multiplexer's connection carries every dflashops invocation of this user to this host.
            raise TransportError(
                f"{self.name}: the host refused a new session ({exc.text or exc.code}) for: {join_argv(argv)}",
                hint="too many commands at once on one connection (sshd's MaxSessions); run it again when some end",
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if transport.is_active():
                # The link is up and only this channel failed to open (its confirmation outlasted the timeout on a
                # loaded host): dropping the link would end every other command on it, as `doctor --all`'s
                # targets on one host saw under load ("Channel closed" for the commands beside it).
                raise TransportError(
                    f"{self.name}: could not start a command: {exc or type(exc).__name__}",
                    hint="the host did not open a session in time; run the command again",
                ) from None
            raise self._start_failed(transport, exc) from None
        try:
            channel.exec_command(self.command_line(argv, env))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._start_failed(transport, exc) from None
        return channel

    def _drop(self, link: paramiko.Transport | None, why: str) -> None:
        """Close `link`, the connection a command ran on, and forget it if it is still this transport's. A newer
        connection that another thread made meanwhile (a multiplexer serves many) stays up."""
        with self._lock:
            if self._conn is not None and self._conn.transport is link:
                self._close_quietly(why)
                return
        if link is not None:
            mark_closed_here(link, why)
            link.close()

    def _start_failed(self, link: paramiko.Transport, exc: BaseException) -> TransportError:
        """The link broke while a command was being started: drop it (the next command reconnects)."""
        self._drop(link, f"{LOCAL_CLOSE}: starting a command failed ({exc or type(exc).__name__})")
        return TransportError(
            f"{self.name}: could not start a command: {exc or type(exc).__name__}",
            hint="the connection broke; run the command again",
        )

    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        return self._run_channel(argv, env, stdin, timeout, None)

    def _run_watched(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink,
    ) -> tuple[int, bytes, bytes]:
        return self._run_channel(argv, env, stdin, timeout, on_stderr)

    def _run_channel(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink | None,
    ) -> tuple[int, bytes, bytes]:
        channel = self._open_channel(argv, env)
        feeder = _start_feeder(channel, stdin)
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for chunk in self._drain(channel, err, deadline, argv, on_stderr):
                out += chunk
        finally:
            _close_quietly(channel)
        feeder.join(timeout=1)
        return self._exit_code(channel, argv), bytes(out), bytes(err)

    def stream(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> Iterator[bytes]:
        """Yield stdout chunks as they arrive (exit code ignored, as in the local transport); a lost
        connection raises TransportError mid-iteration. Closing the generator closes the channel."""
        channel = self._open_channel(argv, {**self.default_env, **(env or {})})
        channel.shutdown_write()
        deadline = None if timeout is None else time.monotonic() + timeout
        err = bytearray()
        try:
            yield from self._drain(channel, err, deadline, argv)
            self._exit_code(channel, argv)  # raises when the link dropped; an exit code is not an error here
        finally:
            _close_quietly(channel)

    def _drain(
        self,
        channel: paramiko.Channel,
        err: bytearray,
        deadline: float | None,
        argv: Sequence[str],
        on_stderr: StderrSink | None = None,
    ) -> Iterator[bytes]:
        """Yield stdout, collect stderr (handed to `on_stderr` too as it arrives), until the channel closes;
        bounded by deadline and liveness probes."""
        # Wake on data (the channel's fileno is a pipe paramiko sets when stdout or stderr data lands);
        # the 0.2 s select timeout bounds every check below even if a wake-up is missed.
        wake = channel.fileno()
        last_data = time.monotonic()
        while True:
            got = False
            try:
                while channel.recv_stderr_ready():
                    piece = channel.recv_stderr(CHUNK)
                    err += piece
                    if on_stderr is not None:
                        on_stderr(piece)
                    got = True
                chunk = channel.recv(CHUNK) if channel.recv_ready() else None
            except (paramiko.SSHException, OSError, EOFError) as exc:  # e.g. a key exchange that timed out
                self._drop(channel.get_transport(), f"{LOCAL_CLOSE}: a read failed ({exc or type(exc).__name__})")
                raise TransportError(
                    f"{self.name}: connection broke during: {join_argv(argv)} ({exc})",
                    hint="run it again; the next command reconnects",
                ) from None
            if chunk:
                got = True
                yield chunk
            elif chunk is None and (channel.eof_received or channel.closed):
                break
            now = time.monotonic()
            if got:
                last_data = now
                continue
            if deadline is not None and now > deadline:
                raise TransportError(
                    f"{self.name}: command timed out: {join_argv(argv)}", hint="raise the timeout, or check the target"
                )
            if now - last_data > IDLE_PROBE_S:
                self._probe_alive(channel.get_transport(), argv)
                last_data = time.monotonic()
            select.select([wake], [], [], 0.2)
        while not channel.exit_status_ready() and _active(channel):
            time.sleep(0.005)
        while channel.recv_stderr_ready():
            piece = channel.recv_stderr(CHUNK)
            err += piece
            if on_stderr is not None:
                on_stderr(piece)

    def _probe_alive(self, transport: paramiko.Transport | None, argv: Sequence[str]) -> None:
        """A keepalive on the command's link that wants a reply; none within PROBE_TIMEOUT_S means it is gone."""
        answered = threading.Event()

        def ask() -> None:
            # OpenSSH answers an unknown global request with a failure reply: any answer proves liveness;
            # paramiko returns from the wait either way, so liveness is read from the transport after it.
            try:
                if transport is not None:
                    transport.global_request("keepalive@openssh.com", wait=True)
                    if transport.is_active():
                        answered.set()
            except Exception:  # noqa: BLE001 - a dying transport raises various things
                pass

        threading.Thread(target=ask, daemon=True).start()
        if not answered.wait(PROBE_TIMEOUT_S) and transport is not None:
            self._drop(transport, f"{LOCAL_CLOSE}: no answer to a liveness probe in {PROBE_TIMEOUT_S:.0f}s")
            raise TransportError(
                f"{self.name}: connection stalled (no answer in {PROBE_TIMEOUT_S:.0f}s) during: {join_argv(argv)}",
                hint="check the network; run it again",
            )

    def _exit_code(self, channel: paramiko.Channel, argv: Sequence[str]) -> int:
        code = channel.exit_status if channel.exit_status_ready() else -1
        if code == -1:
            if not _active(channel):
                reason = link_loss_reason(channel.get_transport())
                self._drop(channel.get_transport(), reason)
                raise TransportError(
                    f"{self.name}: connection lost during: {join_argv(argv)} ({reason})",
                    hint="the link dropped; the next command reconnects",
                )
            return 255  # killed by a signal (exit-signal): what OpenSSH's client reports too
        return code


def mark_closed_here(link: paramiko.Transport | None, why: str) -> None:
    """Record why this side is closing a link that is still up; a link already gone keeps its own cause."""
    if link is not None and link.is_active() and not getattr(link, CLOSED_HERE, None):
        setattr(link, CLOSED_HERE, why)


def _active(channel: paramiko.Channel) -> bool:
    """The channel's own link is up (not the transport's current one: another thread may have reconnected)."""
    link = channel.get_transport()
    return bool(link is not None and link.is_active())


def link_loss_reason(transport: paramiko.Transport | None) -> str:
    """Why a paramiko link is gone, in words: why this side closed it (CLOSED_HERE: a liveness probe, another
    command's failure on a shared connection, close()), else what ssh_connect.RecordedLink kept (a server's
    DISCONNECT, an unmarked close's caller), else the exception that ended its thread (EOF when the far end
    closed the connection). A local close is kept first: the thread of a link closed here often ends on an EOF
    of its own socket too."""
    here = getattr(transport, CLOSED_HERE, None) or getattr(transport, ENDED_BY, None)
    if here:
        return str(here)
    saved = getattr(transport, "saved_exception", None)
    if isinstance(saved, (EOFError, ConnectionResetError)):
        return "closed from the far end: the server or something on the way"
    if saved is not None:
        return f"{type(saved).__name__}: {saved}" if str(saved) else type(saved).__name__
    return "no cause recorded"


def _start_feeder(channel: paramiko.Channel, stdin: Stdin) -> threading.Thread:
    """Write stdin to the channel in a thread, then half-close it so the command sees EOF."""

    def feed() -> None:
        try:
            if isinstance(stdin, (bytes, bytearray, memoryview)):
                view = memoryview(stdin)
                for start in range(0, len(view), CHUNK):
                    channel.sendall(view[start : start + CHUNK])  # type: ignore[arg-type]  # any buffer works
            elif stdin is not None:
                while chunk := stdin.read(CHUNK):
                    channel.sendall(chunk)
            channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the reader side reports the broken link with the command's context

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


def _close_quietly(channel: paramiko.Channel) -> None:
    """Close a channel whose link may already be gone: closing sends a message, and on a dead transport
    paramiko raises EOFError/OSError from that send, which would hide the TransportError the caller is
    handling (seen when a cut landed exactly between a command's last byte and its close)."""
    try:
        channel.close()
    except (EOFError, OSError, paramiko.SSHException):
        pass
