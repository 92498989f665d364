"""The ssh multiplexer (dflashops/transport/mux_*.py): CLI invocations share one live connection held by a
background process, which the first invocation starts as it ends (it connected in-process itself), once even
when several start at once; it is replaced when it dies, gone when idle, and never hides a connect error. Real sshd, real processes, the
loopback proxy counting TCP connections."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import REPO, write_inventory
from loopproxy import LoopProxy
from remote_harness import Harness

if TYPE_CHECKING:
    from dflashops.transport.ssh_settings import SshSettings


def run_cli(inventory: Path, *args: str, mux: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The real CLI as a fresh process (the multiplexer's whole point is to span processes)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASHOPS_MUX_DIR": str(mux), **env}
    return subprocess.run(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(inventory), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def daemon_pids(mux: Path) -> list[int]:
    return [
        int(p.read_text()) for p in sorted(mux.glob("*.sock.pid")) if Path(f"/proc/{p.read_text().strip()}").exists()
    ]


def wait_for_daemon(mux: Path, other_than: int | None = None, timeout: float = 20.0) -> int:
    """The pid of the multiplexer an invocation started in its background, once it listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [pid for pid in daemon_pids(mux) if pid != other_than]
        if pids and list(mux.glob("*.sock")):
            return pids[0]
        time.sleep(0.05)
    raise AssertionError(f"no multiplexer started in {mux}")


def started_daemon(harness: Harness, mux: Path) -> SshSettings:
    """The harness's ssh settings, with a multiplexer for them listening in `mux` (made here, mode 0700): the
    first transport connects in-process and starts it as it closes."""
    from conftest import settings_for

    from dflashops.transport.mux_client import MuxTransport

    mux.mkdir(mode=0o700)
    settings = settings_for(harness)
    first = MuxTransport(name="pve", default_env={}, settings=settings, persist_s=60, folder=mux)
    assert first.run(["true"]).ok
    first.close()
    wait_for_daemon(mux)
    return settings


@pytest.fixture
def setup(tmp_path: Path, harness: Harness, proxy: LoopProxy):
    from dflashops.transport.mux_client import stop_multiplexers

    inventory = write_inventory(
        tmp_path / "inventory.yaml", harness, port=proxy.port, workspace=f"/workspace/{tmp_path.name}"
    )
    mux = tmp_path / "mux"
    yield inventory, mux, proxy
    if mux.is_dir():
        stop_multiplexers(mux)


def test_invocations_share_one_connection(setup) -> None:
    """The first invocation connects itself and starts the multiplexer (2 connections); the next ones open
    none at all."""
    inventory, mux, proxy = setup
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux)
    assert done.returncode == 0, done.stderr
    pid = wait_for_daemon(mux)
    for _ in range(3):
        done = run_cli(inventory, "status", "--target", "ct200", mux=mux)
        assert done.returncode == 0, done.stderr
    assert proxy.connections_accepted == 2 and daemon_pids(mux) == [pid]
    # Off: every invocation connects anew and leaves no daemon behind.
    for _ in range(2):
        assert (
            run_cli(inventory, "status", "--target", "ct200", mux=mux / "off", DFLASHOPS_SSH_PERSIST="0").returncode
            == 0
        )
    assert proxy.connections_accepted == 4 and not (mux / "off").exists()


def test_concurrent_first_invocations_start_one_daemon(setup) -> None:
    inventory, mux, proxy = setup
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASHOPS_MUX_DIR": str(mux)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(inventory), "status", "--target", "ct200"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    wait_for_daemon(mux)
    time.sleep(1.0)  # a second starter, had the lock let one through, would be listening by now
    assert len(daemon_pids(mux)) == 1 and len(list(mux.glob("*.sock"))) == 1


def test_a_killed_daemon_is_replaced_and_a_cut_link_is_reconnected(setup) -> None:
    inventory, mux, proxy = setup
    assert run_cli(inventory, "status", "--target", "ct200", mux=mux).returncode == 0
    first = wait_for_daemon(mux)
    os.kill(first, signal.SIGKILL)  # the daemon this test's CLI started, by its recorded pid
    while Path(f"/proc/{first}").exists():
        time.sleep(0.02)
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux)  # its stale socket refuses: in-process
    assert done.returncode == 0, done.stderr
    second = wait_for_daemon(mux, other_than=first)
    assert proxy.connections_accepted == 4
    proxy.cut_all()  # the daemon's connection dies under it; its next command reconnects
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux)
    assert done.returncode == 0, done.stderr
    assert daemon_pids(mux) == [second] and proxy.connections_accepted == 5


def test_an_idle_daemon_exits_by_itself(setup) -> None:
    inventory, mux, _ = setup
    assert run_cli(inventory, "status", "--target", "ct200", mux=mux, DFLASHOPS_SSH_PERSIST="1").returncode == 0
    pid = wait_for_daemon(mux)
    deadline = time.monotonic() + 15
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() and not list(mux.glob("*.sock"))


def test_connect_errors_come_through_the_daemon_unchanged(setup, harness: Harness, tmp_path: Path) -> None:
    inventory, mux, _ = setup
    strange = tmp_path / "empty_known_hosts"
    strange.write_text("")
    inventory.write_text(inventory.read_text().replace(str(harness.known_hosts), str(strange)))
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux)
    assert done.returncode == 5 and "Traceback" not in done.stderr
    assert "is not known" in done.stderr and "SHA256:" in done.stderr and "dflashops trust pve" in done.stderr
    time.sleep(2.0)  # no multiplexer after a refused connect (one started anyway would meet the same refusal)
    assert daemon_pids(mux) == [] and not list(mux.glob("*.sock"))


def test_bad_settings_of_the_multiplexer_are_one_error_line(setup) -> None:
    inventory, mux, _ = setup
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux, DFLASHOPS_SSH_PERSIST="ten minutes")
    assert done.returncode == 5 and done.stderr.splitlines()[0].startswith("error: DFLASHOPS_SSH_PERSIST=")
    assert done.stderr.splitlines()[1].startswith("hint: ")
    mux.mkdir(mode=0o755)
    mux.chmod(0o755)
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux)
    assert done.returncode == 5 and "is not yours alone" in done.stderr and "hint: " in done.stderr


def test_the_daemon_keeps_no_secret_of_the_shell_that_started_it(setup) -> None:
    """It outlives the invocation (DFLASHOPS_SSH_PERSIST) and /proc/PID/environ keeps what it started with, so
    a shell's secrets (a profile's pass_env: DB_PASS, OPENAI_KEY) must not be there; what it needs is."""
    inventory, mux, _ = setup
    secrets = {"DB_PASS": "db-secret-4711", "OPENAI_KEY": "sk-secret-0815", "MY_NOTE": "unrelated-value-42"}
    assert run_cli(inventory, "status", "--target", "ct200", mux=mux, **secrets).returncode == 0
    pid = wait_for_daemon(mux)  # it wrote its pid file and listens: its own code runs, its environ is final
    assert b"dflashops.transport.mux_server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    assert environ, "empty environ: read before the daemon ran its own code"
    for value in secrets.values():
        assert value.encode() not in b"\0".join(environ.values()), value
    assert environ[b"PYTHONPATH"].split(b":")[0] == str(REPO).encode() and b"HOME" in environ
    assert environ[b"DFLASHOPS_MUX_DIR"] == str(mux).encode()
    # Commands still go through it (the shell's own environment is not what they need).
    done = run_cli(inventory, "status", "--target", "ct200", mux=mux, **secrets)
    assert done.returncode == 0, done.stderr
    assert daemon_pids(mux) == [pid]


class Reads(io.BufferedReader):
    """A file object that records how many bytes each read gave its caller."""

    def __init__(self, raw: io.RawIOBase | io.BytesIO) -> None:
        super().__init__(raw)  # type: ignore[arg-type]  # BytesIO is a readable raw stream here
        self.sizes: list[int] = []

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.sizes.append(len(data))
        return data


def test_stdin_goes_through_the_daemon_in_frames_and_an_unread_one_does_not_hang(
    harness: Harness, tmp_path: Path
) -> None:
    """Stdin larger than one frame (a release's tar, read from a file as it is sent) arrives whole through the
    multiplexer, and a command that exits without reading its stdin (an agent that refuses first) answers at
    once, with more stdin than the socket holds still to come."""
    from dflashops.transport.mux_client import MuxTransport, stop_multiplexers

    mux = tmp_path / "mux"
    settings = started_daemon(harness, mux)
    try:
        through = MuxTransport(name="pve", default_env={}, settings=settings, persist_s=60, folder=mux)
        data = os.urandom((5 << 20) + 123)  # five full frames and a part
        digest = "import hashlib,sys;print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
        source = Reads(io.BytesIO(data))
        done = through.run(["python3", "-c", digest], stdin=source, timeout=60)
        assert through._via_mux is True
        assert done.stdout.strip() == hashlib.sha256(data).hexdigest()
        assert 0 < max(source.sizes) <= 1 << 20  # read a frame at a time (it was read whole: 5 MiB at once)
        started = time.monotonic()
        unread = through.run(["sh", "-c", "exit 3"], stdin=os.urandom(32 << 20), check=False, timeout=60)
        assert unread.exit_code == 3 and time.monotonic() - started < 30
        assert through.run(["echo", "next"]).stdout == "next\n"  # the daemon took the next command as usual
        through.close()
    finally:
        stop_multiplexers(mux)


def test_stderr_comes_through_the_daemon_while_the_command_runs(harness: Harness, tmp_path: Path) -> None:
    """A watched command's stderr (a remote restart's phases) reaches the caller as it is written, not at the end:
    the command waits for a file that the caller makes only when it has seen the first line. If the daemon
    held stderr to the end, the command would wait out its 30 s and fail. A caller gone meanwhile ends nothing."""
    from dflashops.transport.mux_client import MuxTransport, stop_multiplexers
    from dflashops.transport.mux_frames import recv_frame, send_json

    mux = tmp_path / "mux"
    settings = started_daemon(harness, mux)
    shared = Path(tempfile.mkdtemp(prefix="dfo-seen-"))  # pytest's folders are root's alone (0700)
    shared.chmod(0o1777)  # the harness user reads `seen` and writes `finished` there
    seen = shared / "seen"
    script = (
        f"echo stopping >&2; i=0; while [ ! -e {seen} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
        f"[ -e {seen} ] && echo launched >&2 && echo done"
    )
    pieces: list[str] = []

    def on_stderr(piece: bytes) -> None:
        pieces.append(piece.decode())
        if "stopping" in "".join(pieces):
            seen.touch()

    try:
        through = MuxTransport(name="pve", default_env={}, settings=settings, persist_s=60, folder=mux)
        done = through.run(["sh", "-c", script], on_stderr=on_stderr, timeout=60)
        assert through._via_mux is True
        assert done.stdout == "done\n" and "".join(pieces) == done.stderr == "stopping\nlaunched\n"
        through.close()
        # A client that leaves after the first piece (its terminal closed): the command still runs to its end.
        finished = shared / "finished"
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(next(mux.glob("*.sock"))))
            # each line after the first goes to a gone client: a daemon that ended the command on that would
            # close its stderr, and the last echo would end the shell before the touch
            script = f"echo first >&2; sleep 1; echo more >&2; sleep 1; echo last >&2 && touch {finished}"
            request = {"argv": ["sh", "-c", script]}
            send_json(conn, b"Q", {"op": "run_watched", "env": {}, "timeout": 30, "stdin": False, **request})
            assert recv_frame(conn) == (b"e", b"first\n")
        deadline = time.monotonic() + 20
        while not finished.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert finished.exists()
    finally:
        stop_multiplexers(mux)
        shutil.rmtree(shared)
