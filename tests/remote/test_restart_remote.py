"""The one-call restart over sshd -> pct stand-in: call count, lineage and exit codes, the stale-cache
fallback (the target's releases changed behind this controller's back), and cuts in the combined call."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from loopproxy import LoopProxy
from remote_harness import Harness

from dflashops.core.errors import TransportError
from dflashops.core.inventory import load_inventory
from dflashops.lineage import LineageDB
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases.sync import local_manifest, release_files
from dflashops.ops.runs.restart import RestartOutcome, RestartRequest, restart


def restart_counting(inventory: Path, run: str, **fields: object) -> tuple[RestartOutcome, int]:
    """restart() through the real CLI invocation objects; returns the outcome and how many commands the
    transport really ran (counted at the transport, not taken from the outcome)."""
    inv = load_inventory(inventory)
    invocation = Invocation(inv)
    commands = 0
    try:
        transport = invocation.agent(inv.target("ct200")).transport
        real_run = transport.run

        def counted(*args: object, **kwargs: object) -> object:
            nonlocal commands
            commands += 1
            return real_run(*args, **kwargs)

        transport.run = counted  # type: ignore[method-assign]
        outcome = restart(invocation, RestartRequest(run=run, name="+", **fields))  # type: ignore[arg-type]
    finally:
        invocation.close()
    return outcome, commands


def edit(inventory: Path, text: str) -> None:
    workload = inventory.parent / "workload.py"
    workload.write_text(workload.read_text() + f"# {text}\n")


def assert_release_is(harness: Harness, inventory: Path, release_dir: str) -> None:
    """The release in the container holds exactly this controller's local tree."""
    inv = load_inventory(inventory)
    files = release_files(inv.profile("work").files, inv.root)
    release = harness.container_path("200", release_dir)
    assert os.path.basename(release_dir) == local_manifest(files)[0]
    for rel, local in files.items():
        assert (release / rel).read_bytes() == local.read_bytes(), rel


def test_restart_is_one_call_and_records_lineage_and_exit_codes(inventory: Path, harness: Harness) -> None:
    assert (
        cli("deploy", "ct200", "--profile", "work", "--name", "one-a1", "--wait", r"^step 1 ", "--timeout", "60")[0]
        == 0
    )
    edit(inventory, "one change")
    outcome, commands = restart_counting(inventory, "one-a1", grace=10.0, note="one call")
    assert commands == 1 and outcome.agent_calls == 1 and not outcome.fell_back
    assert outcome.stopped and outcome.old_exit_code is not None and outcome.deployed.uploaded == 1
    assert_release_is(harness, inventory, outcome.deployed.release)
    workspace = f"/workspace/{inventory.parent.name}"
    releases = harness.container_path("200", f"{workspace}/releases")
    assert os.readlink(releases / "current") == outcome.deployed.code_hash
    with LineageDB(inventory.parent / "lineage.sqlite") as db:
        old, new = db.get("one-a1"), db.get("one-a2")
    assert old.state == "stopped" and old.exit_code == outcome.old_exit_code
    assert new.parent == "one-a1" and new.note == "one call" and new.code_hash == outcome.deployed.code_hash
    assert new.extra["pgid"] == outcome.deployed.pgid
    run_json = json.loads(harness.container_path("200", f"{workspace}/runs/one-a2/run.json").read_text())
    assert run_json["parent"] == "one-a1" and run_json["release"] == outcome.deployed.release
    assert cli("logs", "one-a2", "--until", r"^step 1 ", "--timeout", "60")[0] == 0
    code, out, _ = cli("stop", "one-a2", "--grace", "10")
    assert code == 0 and "exit_code=" in out


def test_stale_cache_falls_back_and_installs_the_local_tree(inventory: Path, harness: Harness, tmp_path: Path) -> None:
    workspace = f"/workspace/{inventory.parent.name}"
    releases = harness.container_path("200", f"{workspace}/releases")
    assert cli("deploy", "ct200", "--profile", "work", "--name", "st-a1", "--wait", r"^step 1 ")[0] == 0
    # Another controller (its own folder, lineage and cache; other files) deploys to the same workspace.
    (tmp_path / "other").mkdir()
    other = write_inventory(tmp_path / "other" / "inventory.yaml", harness, workspace=workspace)
    edit(other, "the other controller's code")
    assert cli("--inventory", str(other), "deploy", "--detach", "ct200", "--profile", "work", "--name", "x1")[0] == 0
    moved_to = os.readlink(releases / "current")
    # `current` moved on, but our cached base still exists and is content-addressed: still one call.
    edit(inventory, "ours 1")
    outcome, commands = restart_counting(inventory, "st-a1", grace=10.0)
    assert (commands, outcome.fell_back) == (1, False) and outcome.deployed.code_hash != moved_to
    assert_release_is(harness, inventory, outcome.deployed.release)
    assert cli("stop", "st-a2", "--grace", "10")[0] == 0
    # Now the other controller deploys new code and prunes: our cached base (st-a2's release, no longer
    # in use) is gone.
    edit(other, "the other controller's second change")
    assert (
        cli(
            "--inventory",
            str(other),
            "deploy",
            "--detach",
            "ct200",
            "--profile",
            "work",
            "--name",
            "x2",
            "--",
            "--steps",
            "3",
        )[0]
        == 0
    )
    assert cli("--inventory", str(other), "gc", "ct200", "--keep", "1")[0] == 0
    assert not (releases / outcome.deployed.code_hash).exists()
    edit(inventory, "ours 2")
    second, commands = restart_counting(inventory, "st-a2", grace=10.0)
    # refused (nothing changed) -> manifest -> combined call again
    assert (commands, second.fell_back, second.agent_calls) == (3, True, 3)
    assert not second.stopped  # st-a2 had been stopped already: relaunching is still what was asked
    assert_release_is(harness, inventory, second.deployed.release)
    assert os.readlink(releases / "current") == second.deployed.code_hash
    assert json.loads(cli("status", "st-a3", "--json")[1])["runs"][0]["state"] == "running"
    for name, inv in (("st-a3", inventory), ("x1", other)):
        assert cli("--inventory", str(inv), "stop", name, "--grace", "10")[0] == 0


def visible_releases_complete(releases: Path) -> None:
    for entry in releases.iterdir():
        if entry.name != "current" and not entry.name.startswith("."):
            manifest = json.loads((entry / ".manifest.json").read_text())
            assert all((entry / rel).is_file() for rel in manifest), entry


def test_cut_during_the_combined_call_leaves_nothing_half_done(
    proxied_inventory: Path, harness: Harness, proxy: LoopProxy
) -> None:
    inventory = proxied_inventory
    workspace = f"/workspace/{inventory.parent.name}"
    releases = harness.container_path("200", f"{workspace}/releases")
    runs = harness.container_path("200", f"{workspace}/runs")
    # --ignore-term: the stop needs the whole grace, so a cut can land while the agent is stopping.
    assert (
        cli("deploy", "ct200", "--profile", "work", "--name", "cc-a1", "--wait", r"^step 2 ", "--", "--ignore-term")[0]
        == 0
    )
    old_release = os.readlink(releases / "current")
    (inventory.parent / "blob.bin").write_bytes(os.urandom(2 * 1024 * 1024))  # a 2 MiB upload to cut into
    inv = load_inventory(inventory)
    for cut_at in (48 * 1024, 1024 * 1024, 2000 * 1024):  # early, middle, just before the tar ends
        invocation = Invocation(inv)
        invocation.agent(inv.target("ct200")).ensure()  # connected; what follows is the combined call itself
        proxy.cut_after(upstream_bytes=cut_at)
        with pytest.raises(TransportError, match="connection lost during the restart"):
            restart(invocation, RestartRequest(run="cc-a1", name="+", grace=2.0))
        invocation.close()
        proxy.cut_after(upstream_bytes=1 << 60)  # disarm
        time.sleep(0.5)  # an agent that got a truncated upload refuses at once; give it time to have done so
        assert os.readlink(releases / "current") == old_release
        visible_releases_complete(releases)
        assert not (runs / "cc-a2").exists()  # no launch without a complete release
        assert json.loads(cli("status", "cc-a1", "--json")[1])["runs"][0]["state"] == "running"
    # A cut after the upload, while the agent waits out the grace: it finishes the step on its own. The cut comes
    # when the agent has begun the stop (cc-a1's stop.json: its upload consumed and checked), not at a fixed time:
    # a cut 1.0 s after the start landed inside the upload on a loaded machine, and the agent rightly refused.
    assert not (runs / "cc-a1" / "stop.json").exists()

    def cut_once_stopping() -> None:
        deadline = time.monotonic() + 240
        while not (runs / "cc-a1" / "stop.json").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.cut_all()

    cutter = threading.Thread(target=cut_once_stopping, daemon=True)
    cutter.start()
    with pytest.raises(TransportError, match="connection lost during the restart"):
        cli_restart = Invocation(inv)
        try:
            restart(cli_restart, RestartRequest(run="cc-a1", name="+", grace=4.0))
        finally:
            cli_restart.close()
    cutter.join()
    # The agent stops cc-a1 (its exit code recorded) before it launches cc-a2: wait for both, with a hang guard
    # (a 30 s wait ran out under load with neither there yet), then check what they say.
    deadline = time.monotonic() + 240
    while not ((runs / "cc-a2" / "pgid").exists() and (runs / "cc-a1" / "exit_code").exists()):
        assert time.monotonic() < deadline, "the restart the agent finished on its own did not launch cc-a2"
        time.sleep(0.2)
    assert (runs / "cc-a1" / "exit_code").read_text().strip() == "137"  # TERM ignored, KILL after the grace
    new_release = os.readlink(releases / "current")
    assert new_release != old_release
    visible_releases_complete(releases)
    assert json.loads((runs / "cc-a2" / "run.json").read_text())["release"].endswith(new_release)
    assert (releases / new_release / "blob.bin").read_bytes() == (inventory.parent / "blob.bin").read_bytes()
    # The answer was lost, so the lineage learns of cc-a2 from its run.json.
    assert cli("runs", "sync", "ct200")[0] == 0
    with LineageDB(inventory.parent / "lineage.sqlite") as db:
        assert db.get("cc-a2").parent == "cc-a1"
    assert cli("stop", "cc-a2", "--grace", "10")[0] == 0
