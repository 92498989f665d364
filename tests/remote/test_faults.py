"""Faults on the link (loopback proxy between client and sshd): cuts during sync and during `logs -f`."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from conftest import cli
from loopproxy import LoopProxy
from remote_harness import Harness

from dflashops.core.errors import TransportError
from dflashops.core.inventory import load_inventory
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases.sync import sync
from dflashops.ops.runs.control import LogCursor, read_log


def step_of(harness: Harness, run_dir: str) -> int:
    return json.loads(harness.container_path("200", f"{run_dir}/status.json").read_text())["step"]


def test_cut_during_sync_never_exposes_a_partial_release(
    proxied_inventory: Path, harness: Harness, proxy: LoopProxy
) -> None:
    workspace = f"/workspace/{proxied_inventory.parent.name}"
    releases = harness.container_path("200", f"{workspace}/releases")
    code, out, err = cli(
        "deploy", "ct200", "--profile", "work", "--name", "cut-r1", "--wait", r"^step 2 ", "--timeout", "60"
    )
    assert code == 0, err
    old_release = os.readlink(releases / "current")
    run_dir = f"{workspace}/runs/cut-r1"
    (proxied_inventory.parent / "blob.bin").write_bytes(os.urandom(2 * 1024 * 1024))  # a 2 MiB change to ship

    inventory = load_inventory(proxied_inventory)
    profile = inventory.profile("work")
    for cut_at in (48 * 1024, 1024 * 1024, 2000 * 1024):  # early, middle, and just before the tar ends
        invocation = Invocation(inventory)
        agent = invocation.agent(inventory.target("ct200"))
        agent.ensure()  # connected, container checked, agent present: what follows is the sync itself
        proxy.cut_after(upstream_bytes=cut_at)
        with pytest.raises(TransportError):
            sync(agent, extra_files=profile.files, extra_root=inventory.root)
        invocation.close()
        proxy.cut_after(upstream_bytes=1 << 60)  # disarm
        # `current` still names the old release, and every visible release is complete.
        assert os.readlink(releases / "current") == old_release
        for entry in releases.iterdir():
            if entry.name != "current" and not entry.name.startswith("."):
                manifest = json.loads((entry / ".manifest.json").read_text())
                assert all((entry / rel).is_file() for rel in manifest)
        # The running job is untouched: still running, still making progress.
        before = step_of(harness, run_dir)
        time.sleep(0.3)
        assert step_of(harness, run_dir) > before

    code, out, err = cli(
        "deploy", "ct200", "--profile", "work", "--name", "cut-r2", "--wait", r"^step 1 ", "--timeout", "60"
    )
    assert code == 0, err
    new_release = os.readlink(releases / "current")
    assert new_release != old_release
    assert (releases / new_release / "blob.bin").read_bytes() == (proxied_inventory.parent / "blob.bin").read_bytes()
    assert not [p for p in releases.iterdir() if p.name.startswith(".tmp-")]  # leftovers cleaned by the next install
    entry = json.loads(cli("status", "cut-r1", "--json")[1])["runs"][0]
    assert entry["state"] == "running"
    for name in ("cut-r1", "cut-r2"):
        assert cli("stop", name, "--grace", "10")[0] == 0


def test_cut_during_logs_follow_loses_and_repeats_nothing(
    proxied_inventory: Path, harness: Harness, proxy: LoopProxy
) -> None:
    workspace = f"/workspace/{proxied_inventory.parent.name}"
    code, out, err = cli(
        "deploy",
        "--detach",
        "ct200",
        "--profile",
        "work",
        "--name",
        "follow-r1",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "4000",
        "--interval",
        "0.0005",
    )
    assert code == 0, err
    inventory = load_inventory(proxied_inventory)
    invocation = Invocation(inventory)
    cuts_done = threading.Event()

    def cutter() -> None:
        for _ in range(4):
            time.sleep(0.6)
            proxy.cut_all()
        cuts_done.set()

    threading.Thread(target=cutter, daemon=True).start()
    received: list[str] = []
    cursor = LogCursor()
    for chunk in read_log(invocation, "follow-r1", cursor, target="ct200", follow=True, poll_s=0.1, timeout=120):
        received.append(chunk)
    invocation.close()
    assert cuts_done.wait(5) and proxy.connections_cut >= 3
    on_disk = harness.container_path("200", f"{workspace}/runs/follow-r1/train.log").read_text()
    text = "".join(received)
    assert text == on_disk  # byte for byte: no line lost, none repeated
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 4000 and steps[-1].startswith("step 4000 ")
