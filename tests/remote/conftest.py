"""Fixtures for the remote tier: one real sshd + pct stand-in per session, proxies and inventories per test.

Containers: 200 and 202 running, 201 stopped (created here); 999 does not exist. The test user reaches
`pct` only through `sudo -n` (a NOPASSWD rule on the stand-in), as a non-root Proxmox admin would.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import remote_harness
from loopproxy import LoopProxy

from dflashops.transport.mux_client import stop_multiplexers
from dflashops.transport.pct import PctTransport
from dflashops.transport.ssh import SshSettings, SshTransport

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "tests" / "workloads" / "workload.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/remote" in str(item.fspath):
            item.add_marker(pytest.mark.ssh)


@pytest.fixture(scope="session")
def harness() -> Iterator[remote_harness.Harness]:
    if os.geteuid() != 0:
        pytest.skip("the remote harness needs root (sshd, a test user, namespaces)")
    # The CLI's ssh multiplexers of this session live in their own folder and end with the harness (by the
    # pids they recorded), so no daemon of a test outlives the sshd it was connected to.
    mux_folder = Path(tempfile.mkdtemp(prefix="dfo-mux-"))
    previous = os.environ.get("DFLASHOPS_MUX_DIR")
    os.environ["DFLASHOPS_MUX_DIR"] = str(mux_folder)
    h = remote_harness.start_harness()
    try:
        h.create_container("200", "gpu200")
        h.create_container("201", "gpu201", running=False)
        h.create_container("202", "gpu202")
        yield h
    finally:
        stop_multiplexers(mux_folder)
        h.stop()
        shutil.rmtree(mux_folder, ignore_errors=True)
        if previous is None:
            os.environ.pop("DFLASHOPS_MUX_DIR", None)
        else:
            os.environ["DFLASHOPS_MUX_DIR"] = previous


def settings_for(h: remote_harness.Harness, port: int | None = None, **overrides: object) -> SshSettings:
    fields: dict[str, object] = dict(
        host="127.0.0.1",
        user=h.user,
        port=port or h.port,
        identity_file=str(h.client_key),
        known_hosts=str(h.known_hosts),
        connect_timeout=5.0,
        trust_name="pve",
    )
    fields.update(overrides)
    return SshSettings(**fields)  # type: ignore[arg-type]


@pytest.fixture
def ssh(harness: remote_harness.Harness) -> Iterator[SshTransport]:
    transport = SshTransport(name="pve", settings=settings_for(harness))
    yield transport
    transport.close()


@pytest.fixture
def ct200(harness: remote_harness.Harness) -> Iterator[PctTransport]:
    transport = PctTransport(
        name="ct200", host=SshTransport(name="pve", settings=settings_for(harness)), ctid=200, sudo=True
    )
    yield transport
    transport.close()


@pytest.fixture
def proxy(harness: remote_harness.Harness) -> Iterator[LoopProxy]:
    p = LoopProxy(harness.port).start()
    harness.trust_port(p.port)
    yield p
    p.close()


def write_inventory(
    path: Path,
    h: remote_harness.Harness,
    *,
    port: int | None = None,
    workspace: str = "/workspace/dfo",
    extra_targets: str = "",
) -> Path:
    """A remote inventory: host `pve` (sudo), pct targets ct200, ct201 (stopped), ct202, ct999 (missing),
    and the `work` profile running the controller tests' workload script from the synced release
    (workload.py and a 2 MiB blob.bin are copied next to the inventory: profile files are synced)."""
    shutil.copy(WORKLOAD, path.parent / "workload.py")
    blob = path.parent / "blob.bin"
    if not blob.exists():
        blob.write_bytes(os.urandom(2 * 1024 * 1024))
    path.write_text(
        textwrap.dedent(f"""\
        hosts:
          pve:
            address: 127.0.0.1
            port: {port or h.port}
            user: {h.user}
            identity_file: {h.client_key}
            known_hosts: {h.known_hosts}
            sudo: true
        targets:
          ct200: {{kind: pct, host: pve, ctid: 200, workspace: {workspace}}}
          ct201: {{kind: pct, host: pve, ctid: 201, workspace: {workspace}}}
          ct202: {{kind: pct, host: pve, ctid: 202, workspace: {workspace}}}
          ct999: {{kind: pct, host: pve, ctid: 999, workspace: {workspace}}}
        """)
        + textwrap.indent(textwrap.dedent(extra_targets), "  ")
        + textwrap.dedent("""\
        profiles:
          work:
            argv: ["{python}", "{release}/workload.py", "--output-dir", "{run_dir}", "--steps", "100000",
                   "--interval", "0.05"]
            files: [workload.py, blob.bin]
            check: ["{python}", "{release}/workload.py", "--output-dir", "{run_dir}", "--check-only"]
        """)
    )
    return path


@pytest.fixture
def inventory(tmp_path: Path, harness: remote_harness.Harness, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh workspace per test (its own folder in the containers) and its own lineage database."""
    path = write_inventory(tmp_path / "inventory.yaml", harness, workspace=f"/workspace/{tmp_path.name}")
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    return path


@pytest.fixture
def proxied_inventory(
    tmp_path: Path, harness: remote_harness.Harness, proxy: LoopProxy, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Like `inventory`, but the host is reached through the loopback fault proxy (tests cut the link)."""
    path = write_inventory(
        tmp_path / "inventory.yaml", harness, port=proxy.port, workspace=f"/workspace/{tmp_path.name}"
    )
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    return path


def cli(*args: str) -> tuple[int, str, str]:
    """Run the real CLI entry point in-process; returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from dflashops.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()
