"""The harness's own parts behave like the real ones they stand in for (pct, the proxy)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from loopproxy import LoopProxy
from remote_harness import STANDIN_DIR, Harness


def test_pct_list_status_and_proxmox_error_words(harness: Harness) -> None:
    listing = harness.pct("list").stdout.splitlines()
    assert listing[0].split() == ["VMID", "Status", "Lock", "Name"]
    rows = {line.split()[0]: line.split()[1] for line in listing[1:]}
    assert rows["200"] == "running" and rows["201"] == "stopped"
    assert harness.pct("status", "201").stdout == "status: stopped\n"
    missing = harness.pct("status", "999", check=False)
    assert missing.returncode == 255
    assert missing.stderr == f"Configuration file 'nodes/{socket.gethostname()}/lxc/999.conf' does not exist\n"
    stopped = harness.pct("exec", "201", "--", "true", check=False)
    assert stopped.returncode == 255 and stopped.stderr == "CT 201 not running\n"


def test_push_pull_roundtrip_and_private_workspace(harness: Harness, tmp_path: Path) -> None:
    source = tmp_path / "payload.bin"
    source.write_bytes(os.urandom(100_000))
    harness.pct("push", "200", str(source), "/workspace/pushed.bin")
    assert harness.container_path("200", "/workspace/pushed.bin").read_bytes() == source.read_bytes()
    assert not Path("/workspace/pushed.bin").exists()  # the host's /workspace is not the container's
    back = tmp_path / "back.bin"
    harness.pct("pull", "200", "/workspace/pushed.bin", str(back))
    assert back.read_bytes() == source.read_bytes()
    # Containers do not see each other's workspace.
    assert harness.in_container("202", "test", "-e", "/workspace/pushed.bin", check=False).returncode == 1


def test_container_state_persists_between_calls_until_stopped(harness: Harness) -> None:
    harness.create_container("203", "gpu203")
    pid = harness.in_container("203", "sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $!").stdout.strip()
    assert harness.in_container("203", "kill", "-0", pid).returncode == 0  # a later call still sees it
    harness.pct("stop", "203")
    assert harness.pct("status", "203").stdout == "status: stopped\n"
    harness.pct("start", "203")
    assert harness.in_container("203", "kill", "-0", pid, check=False).returncode != 0  # gone with its namespace
    harness.pct("stop", "203")


def test_keep_env_modes(harness: Harness) -> None:
    env = {**harness.standin_env, "HOST_ONLY_VAR": "x"}
    standin = str(STANDIN_DIR / "pct")
    cleared = subprocess.run(
        [standin, "exec", "200", "--keep-env", "0", "--", "env"], capture_output=True, text=True, env=env
    ).stdout
    kept = subprocess.run(
        [standin, "exec", "200", "--keep-env", "1", "--", "env"], capture_output=True, text=True, env=env
    ).stdout
    assert "HOST_ONLY_VAR=x" not in cleared and "HOST_ONLY_VAR=x" in kept


def test_proxy_latency_and_counters(harness: Harness, proxy: LoopProxy) -> None:
    proxy.latency_s = 0.05
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        started = time.monotonic()
        banner = sock.recv(64)
        assert banner.startswith(b"SSH-2.0-")
        assert time.monotonic() - started >= 0.045  # the server's banner was held back by the added latency
        sock.sendall(b"SSH-2.0-probe\r\n")
        time.sleep(0.2)
    assert proxy.bytes_up == len(b"SSH-2.0-probe\r\n") and proxy.bytes_down >= len(banner)
