"""The ssh transport against a real sshd: reuse, binary stdin, streaming, host keys, auth, outages."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest
from conftest import settings_for
from loopproxy import LoopProxy
from remote_harness import Harness, free_port, start_sshd

import dflashops.transport.ssh as ssh_module
from dflashops.core.errors import TransportError
from dflashops.transport.ssh import SshSettings, SshTransport


def test_one_connection_is_reused_for_every_command(ssh: SshTransport) -> None:
    first = ssh.run(["sh", "-c", "echo $PPID"])  # the sshd session process differs per channel...
    connection = ssh.connection()
    for _ in range(3):
        assert ssh.run(["true"]).ok
    assert ssh.connection() is connection  # ...but the TCP/SSH connection is the same one
    assert first.target == "pve"


def test_binary_stdin_roundtrip_is_exact(ssh: SshTransport) -> None:
    data = os.urandom(3 * 1024 * 1024) + bytes(range(256)) * 64  # NULs, CR/LF, invalid UTF-8
    result = ssh.run(["sha256sum"], stdin=data)
    assert result.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_stdin_and_large_stderr_do_not_deadlock(ssh: SshTransport) -> None:
    # The command writes 2 MiB to stderr before reading stdin: with a naive send-then-read this hangs.
    script = "head -c 2097152 /dev/zero >&2; wc -c"
    result = ssh.run(["sh", "-c", script], stdin=b"x" * (4 * 1024 * 1024), timeout=60)
    assert result.stdout.strip() == str(4 * 1024 * 1024)
    assert len(result.stderr) == 2 * 1024 * 1024


def test_argv_is_quoted_once_and_env_is_passed(ssh: SshTransport) -> None:
    tricky = ["a b", "$(touch /tmp/pwned-dfo)", "it's", ";rm -rf /", "\\n"]
    result = ssh.run(["printf", "%s\\n", *tricky], env={"DFO_VALUE": "x y;z"})
    assert result.stdout.splitlines() == tricky
    assert not Path("/tmp/pwned-dfo").exists()
    assert ssh.run(["sh", "-c", "echo $DFO_VALUE"], env={"DFO_VALUE": "x y;z"}).stdout == "x y;z\n"


def test_exit_codes_and_streaming(ssh: SshTransport) -> None:
    assert ssh.run(["sh", "-c", "exit 7"], check=False).exit_code == 7
    chunks = list(ssh.stream(["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.05; done"]))
    assert b"".join(chunks) == b"line1\nline2\nline3\n"


def test_unknown_host_key_is_refused_with_fingerprint_and_trust_hint(harness: Harness, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    transport = SshTransport(name="pve", settings=settings_for(harness, known_hosts=str(empty)))
    with pytest.raises(TransportError) as caught:
        transport.run(["true"])
    expected = "SHA256:" + __import__("base64").b64encode(
        hashlib.sha256(
            __import__("base64").b64decode((harness.root / "ssh_host_ed25519_key.pub").read_text().split()[1])
        ).digest()
    ).decode().rstrip("=")
    assert "not known" in caught.value.message and expected in caught.value.message
    assert caught.value.hint and "dflashops trust pve" in caught.value.hint
    assert empty.read_text() == ""  # nothing was auto-added (Fabric's default would have)


def test_changed_host_key_is_refused(harness: Harness, tmp_path: Path) -> None:
    other = tmp_path / "other_key"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {other}")
    key_type, key_b64 = (tmp_path / "other_key.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{harness.port} {key_type} {key_b64}\n")
    with pytest.raises(TransportError, match="CHANGED"):
        SshTransport(name="pve", settings=settings_for(harness, known_hosts=str(known))).run(["true"])


def test_wrong_key_is_an_authentication_error(harness: Harness) -> None:
    wrong = str(harness.root / "ssh_host_ed25519_key")  # a valid private key, not authorized
    with pytest.raises(TransportError) as caught:
        SshTransport(name="pve", settings=settings_for(harness, identity_file=wrong)).run(["true"])
    assert caught.value.message.startswith("authentication failed for dfotest@127.0.0.1")
    assert "authorized_keys" in (caught.value.hint or "")


def test_sshd_down_is_a_clear_error_at_once(harness: Harness) -> None:
    started = time.monotonic()
    with pytest.raises(TransportError, match="connection refused"):
        SshTransport(name="pve", settings=settings_for(harness, port=free_port())).run(["true"])
    assert time.monotonic() - started < 2


def test_unresponsive_host_fails_within_the_connect_timeout(harness: Harness, proxy: LoopProxy) -> None:
    proxy.stall()  # TCP connects, but no byte ever comes back (a hung host / black-holed link)
    started = time.monotonic()
    with pytest.raises(TransportError) as caught:
        SshTransport(name="pve", settings=settings_for(harness, port=proxy.port, connect_timeout=2)).run(["true"])
    assert 1.5 < time.monotonic() - started < 6
    assert "127.0.0.1" in caught.value.message


def test_reconnects_after_the_link_was_cut(harness: Harness, proxy: LoopProxy) -> None:
    transport = SshTransport(name="pve", settings=settings_for(harness, port=proxy.port))
    assert transport.run(["echo", "one"]).stdout == "one\n"
    proxy.cut_all()
    time.sleep(0.2)
    assert transport.run(["echo", "two"]).stdout == "two\n"  # transparently a new connection
    transport.close()


def test_cut_during_a_command_raises_transport_error(harness: Harness, proxy: LoopProxy) -> None:
    transport = SshTransport(name="pve", settings=settings_for(harness, port=proxy.port))
    transport.run(["true"])
    proxy.cut_after(upstream_bytes=256 * 1024)
    with pytest.raises(TransportError, match="lost|broke|could not start"):
        transport.run(["wc", "-c"], stdin=b"z" * (8 * 1024 * 1024), timeout=30)
    transport.close()


def assert_a_cut_mid_command_says(transport: SshTransport, cut: Callable[[], None], cause: str) -> None:
    """`cut` once a command has printed (it is running); the command's "connection lost" names `cause`."""
    stream = transport.stream(["sh", "-c", "echo running; sleep 20"], timeout=30)
    assert next(stream) == b"running\n"
    cut()
    with pytest.raises(TransportError, match=rf"connection lost during: sh -c .*\({cause}"):
        next(stream)


def test_a_link_lost_mid_command_says_which_end_closed_it(harness: Harness, proxy: LoopProxy) -> None:
    """The "connection lost" error carries the link's own cause: EOF when the far end closed it (here the proxy
    cuts both sockets), or why this side closed it (close() here; a liveness probe or another command's failure
    on a shared multiplexer connection say theirs). Each cut comes once the command has printed: it is running."""
    transport = SshTransport(name="pve", settings=settings_for(harness, port=proxy.port))
    for cut, cause in ((proxy.cut_all, "closed from the far end"), (transport.close, "closed on this side")):
        assert_a_cut_mid_command_says(transport, cut, cause)
    transport.close()


def test_a_link_ended_without_an_exception_still_says_why(harness: Harness) -> None:
    """paramiko records no exception for two ends of a link: a DISCONNECT from the server and a close() by code
    that did not mark why; both used to read "no cause recorded". Here sshd disconnects for real (a data packet
    for a channel that does not exist is a protocol error to OpenSSH), and a close() comes from this test."""
    transport = SshTransport(name="pve", settings=settings_for(harness))

    def protocol_error() -> None:
        m = paramiko.Message()
        m.add_byte(paramiko.common.cMSG_CHANNEL_DATA)
        m.add_int(999)
        m.add_string(b"x")
        transport.connection()._send_user_message(m)  # type: ignore[attr-defined]  # what a broken client sends

    cases = (
        (protocol_error, r"the server disconnected \(code 2\): .*nonexistent channel 999"),
        (lambda: transport.connection().close(), r"closed in this process, no cause given, by test_ssh_transport"),
    )
    for cut, cause in cases:
        assert_a_cut_mid_command_says(transport, cut, cause)
    transport.close()


def test_a_command_whose_link_died_fails_even_after_another_reconnected(harness: Harness, proxy: LoopProxy) -> None:
    """On a shared transport (a multiplexer's, used by many threads) a command whose own link was cut raises
    "connection lost" also when another command has reconnected meanwhile: it used to read the new link as
    its own, end as if the command had finished (exit 255; a stream just stopped), and the new link stayed up
    only by luck. The new link is left alone."""
    transport = SshTransport(name="pve", settings=settings_for(harness, port=proxy.port))
    stream = transport.stream(["sh", "-c", "echo running; sleep 20"], timeout=30)
    assert next(stream) == b"running\n"
    first = transport.connection()
    proxy.cut_all()
    deadline = time.monotonic() + 10
    while first.is_active():  # paramiko's thread has seen the cut
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert transport.run(["echo", "other"]).stdout == "other\n"  # another user of the transport reconnects
    second = transport.connection()
    assert second is not first
    with pytest.raises(TransportError, match=r"connection lost during: sh -c .*\(closed from the far end"):
        next(stream)
    assert transport.connection() is second and transport.run(["echo", "still"]).stdout == "still\n"
    transport.close()


@pytest.fixture
def two_session_sshd(harness: Harness, tmp_path: Path) -> Iterator[int]:
    """A second real sshd of the harness (same host key, user and keys) that allows two sessions per
    connection, as a host whose MaxSessions is reached (OpenSSH's default is 10); its port."""
    port = free_port()
    sshd = start_sshd(harness.root, port, folder=tmp_path, max_sessions=2)
    try:
        harness.trust_port(port)
        yield port
    finally:
        sshd.terminate()  # our own child, by its handle
        sshd.wait(10)


def test_a_session_the_host_refuses_fails_alone_and_the_link_stays(two_session_sshd: int, harness: Harness) -> None:
    """A third command at once on a connection whose host allows two sessions is refused by the host; that
    command fails with its own error, the two running ones go on and the connection is not dropped (a
    multiplexer's one connection carries every invocation's commands: closing it would end them all)."""
    go = harness.root / f"go-{two_session_sshd}"  # the two commands hold their sessions until it exists
    hold = f"echo running; while [ ! -e {go} ]; do sleep 0.05; done; echo done"
    transport = SshTransport(name="pve", settings=settings_for(harness, port=two_session_sshd))
    try:
        streams = [transport.stream(["sh", "-c", hold], timeout=60) for _ in range(2)]
        assert [next(stream) for stream in streams] == [b"running\n"] * 2  # both sessions are open
        link = transport.connection()
        with pytest.raises(TransportError, match=r"the host refused a new session \(.+\) for: true") as refused:
            transport.run(["true"])
        assert "MaxSessions" in (refused.value.hint or "") and transport.connected
        go.touch()
        assert [b"".join(stream) for stream in streams] == [b"done\n"] * 2  # they ran on to their end
        assert transport.run(["echo", "after"]).stdout == "after\n" and transport.connection() is link
    finally:
        go.unlink(missing_ok=True)
        transport.close()


def test_a_session_that_opens_too_slowly_fails_alone_and_the_link_stays(harness: Harness, proxy: LoopProxy) -> None:
    """A channel whose opening outlasts its timeout (the host's answer held back, as on a loaded host) fails that
    command only: the command running on the same connection goes on (dropping the link ended every command on it:
    `doctor --all` under load, "Channel closed" for the targets beside the slow one)."""
    go = harness.root / "go-slow-open"
    hold = f"echo running; while [ ! -e {go} ]; do sleep 0.05; done; echo done"
    settings = settings_for(harness, port=proxy.port, connect_timeout=0.5)
    transport = SshTransport(name="pve", settings=settings)
    try:
        stream = transport.stream(["sh", "-c", hold], timeout=60)
        assert next(stream) == b"running\n"
        link = transport.connection()
        proxy.stall()  # the host's confirmation of the next session does not arrive within 0.5 s
        with pytest.raises(TransportError, match="could not start a command"):
            transport.run(["true"])
        proxy.resume()
        assert transport.connected and transport.connection() is link
        go.touch()
        assert b"".join(stream) == b"done\n"  # it ran on to its end
        assert transport.run(["echo", "after"]).stdout == "after\n"
    finally:
        proxy.resume()
        go.touch()  # a held command ends even when an assertion failed first (no shell left polling)
        transport.close()


def test_stalled_link_during_a_stream_is_detected(
    harness: Harness, proxy: LoopProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssh_module, "IDLE_PROBE_S", 0.5)
    monkeypatch.setattr(ssh_module, "PROBE_TIMEOUT_S", 1.0)
    transport = SshTransport(name="pve", settings=settings_for(harness, port=proxy.port))
    stream = transport.stream(["sh", "-c", "echo first; sleep 30"])
    assert next(stream) == b"first\n"
    proxy.stall()
    started = time.monotonic()
    with pytest.raises(TransportError, match="stalled"):
        next(stream)
    assert time.monotonic() - started < 5
    proxy.resume()
    transport.close()


def test_ssh_config_alias_user_port_identity_and_proxyjump(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host jumpbox\n  HostName 127.0.0.1\n  Port {harness.port}\n  User {harness.user}\n"
        f"  IdentityFile {harness.client_key}\n"
        f"Host gpu-box\n  HostName 127.0.0.1\n  Port {harness.port}\n  User {harness.user}\n"
        f"  IdentityFile {harness.client_key}\n  ProxyJump jumpbox\n"
    )
    monkeypatch.setenv("DFLASHOPS_SSH_CONFIG", str(config))
    transport = SshTransport(name="gpu-box", settings=SshSettings(host="gpu-box", known_hosts=str(harness.known_hosts)))
    assert transport.run(["whoami"]).stdout.strip() == harness.user
    assert transport._conn is not None and transport._conn.gateway is not None
    assert transport._conn.gateway.is_connected  # the traffic really went through the jump host
    transport.close()


def test_inventory_gateway_is_used_and_checked(harness: Harness, tmp_path: Path) -> None:
    jump = settings_for(harness, trust_name="jump")
    transport = SshTransport(name="pve", settings=settings_for(harness, gateway=jump))
    assert transport.run(["echo", "via-jump"]).stdout == "via-jump\n"
    assert transport._conn is not None and transport._conn.gateway.is_connected
    transport.close()
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    untrusted_jump = settings_for(harness, trust_name="jump", known_hosts=str(empty))
    with pytest.raises(TransportError, match="not known"):
        SshTransport(name="pve", settings=settings_for(harness, gateway=untrusted_jump)).run(["true"])
