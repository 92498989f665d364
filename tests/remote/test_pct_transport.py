"""The pct transport through sshd -> sudo -> pct stand-in -> container namespaces."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from conftest import settings_for
from remote_harness import Harness

from dflashops.core.errors import NotFound, TransportError
from dflashops.transport.base import Stdin
from dflashops.transport.pct import PctTransport
from dflashops.transport.ssh import SshSettings, SshTransport


class CountingSsh(SshTransport):
    """The real ssh transport, recording each host command line (to count `pct status` calls)."""

    seen: list[list[str]]

    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        self.seen.append(list(argv))
        return super()._run(argv, env=env, stdin=stdin, timeout=timeout)


def pct_for(harness: Harness, ctid: int, *, sudo: bool = True) -> PctTransport:
    return PctTransport(
        name=f"ct{ctid}", host=SshTransport(name="pve", settings=settings_for(harness)), ctid=ctid, sudo=sudo
    )


def test_commands_run_inside_the_container_namespaces(ct200: PctTransport, harness: Harness) -> None:
    # Own PID namespace: the shell is a low PID under the container's init (PID 1), not a host PID.
    pid = int(ct200.run(["sh", "-c", "echo $$"]).stdout)
    assert pid < 1000
    assert "python3" in ct200.run(["cat", "/proc/1/comm"]).stdout
    # Private /tmp that persists between calls, invisible from the host's /tmp.
    marker = f"/tmp/dfo-marker-{os.getpid()}"
    ct200.run(["sh", "-c", f"echo inside > {marker}"])
    assert ct200.run(["cat", marker]).stdout == "inside\n"
    assert not Path(marker).exists()
    assert ct200.run(["id", "-u"]).stdout.strip() == "0"  # root inside the container, dfotest on the host


def test_keep_env_0_and_explicit_env(ct200: PctTransport) -> None:
    env_lines = ct200.run(["env"], env={"RUN_MARK": "a b"}).stdout.splitlines()
    assert "RUN_MARK=a b" in env_lines
    assert not any(line.startswith(("SUDO_", "SSH_", "USER=dfotest")) for line in env_lines)


def test_binary_stdin_reaches_the_container_intact(ct200: PctTransport) -> None:
    data = os.urandom(1024 * 1024) + b"\x00\r\n\xff"
    assert ct200.run(["sha256sum"], stdin=data).stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_exit_code_of_the_inner_command_passes_through(ct200: PctTransport) -> None:
    assert ct200.run(["sh", "-c", "exit 3"], check=False).exit_code == 3


def test_status_is_checked_once_per_invocation_before_the_first_exec(harness: Harness) -> None:
    host = CountingSsh(name="pve", settings=settings_for(harness))
    host.seen = []
    transport = PctTransport(name="ct200", host=host, ctid=200, sudo=True)
    for _ in range(3):
        transport.run(["true"])
    # The first host command chains `pct status` before `pct exec` (one round trip); the rest only exec.
    assert len(host.seen) == 3 and "sudo -n pct status 200" in host.seen[0][2]
    assert host.seen[0][4:9] == ["sudo", "-n", "pct", "exec", "200"]
    assert all(argv[:5] == ["sudo", "-n", "pct", "exec", "200"] for argv in host.seen[1:])
    assert sum("pct status" in " ".join(argv) for argv in host.seen) == 1
    transport.close()


def test_stopped_container_is_refused_with_proxmox_words(harness: Harness) -> None:
    with pytest.raises(TransportError) as caught:
        pct_for(harness, 201).run(["true"])
    assert caught.value.message.startswith("container 201 on pve is stopped")
    assert "pct start 201" in (caught.value.hint or "")


def test_missing_container_is_refused_with_proxmox_words(harness: Harness) -> None:
    with pytest.raises(NotFound) as caught:
        pct_for(harness, 999).run(["true"])
    assert "Configuration file 'nodes/" in caught.value.message and "999.conf' does not exist" in caught.value.message


def test_without_sudo_a_non_root_user_gets_the_sudo_hint(harness: Harness) -> None:
    with pytest.raises(TransportError) as caught:
        pct_for(harness, 200, sudo=False).run(["true"])
    assert "needs root" in caught.value.message and "sudo: true" in (caught.value.hint or "")


def test_a_kill_inside_cannot_reach_the_host(ct200: PctTransport) -> None:
    # Every process the container can see is its own: the host's sshd/pytest are not there to signal.
    visible = ct200.run(["sh", "-c", "ls /proc | grep -E '^[0-9]+$'"]).stdout.split()
    assert str(os.getpid()) not in visible or int(max(visible, key=int)) < 1000
    comms = ct200.run(["sh", "-c", "cat /proc/[0-9]*/comm"]).stdout
    assert "sshd" not in comms and "pytest" not in comms


def test_invalid_ctid_is_refused_before_connecting() -> None:
    unused_host = SshTransport(name="h", settings=SshSettings(host="127.0.0.1", port=1))
    with pytest.raises(ValueError, match="CTID"):
        PctTransport(name="x", host=unused_host, ctid=12)
