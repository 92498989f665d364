"""Auto-recovery in a pct stand-in container reached through sshd, while the controller is cut off: the
supervisor restarts the crashing workload with no controller connected (the proxy refuses every connection
meanwhile, as a laptop that went to sleep), and the next `status` records the supervisor-made runs in the
lineage; a hung workload is stopped within its window; `stop` reaches the supervisor too."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import cli
from loopproxy import LoopProxy
from remote_harness import Harness

SECRET = "remote-s3cret-never-on-disk"


def add_profiles(inventory: Path, workspace: str) -> None:
    common = '"{python}", "{release}/workload.py", "--output-dir", "{run_dir}", "--interval", "0.02"'
    inventory.write_text(
        inventory.read_text()
        + f"""\
  flaky:
    argv: [{common}, "--steps", "30", "--save-every", "5", "--crash-at", "12", "--crash-times", "2",
           "--state-file", "{workspace}/starts"]
    files: [workload.py]
    resume_args: [--resume-from, "{{checkpoint}}"]
    pass_env: [WORKLOAD_SECRET]
    on_failure: {{resume: true, max_restarts: 3, backoff: 0.5s}}
  hung:
    argv: [{common}, "--steps", "1000", "--hang-after", "4"]
    files: [workload.py]
    stall: {{heartbeat: 2s, grace: 5s}}
    on_failure: {{max_restarts: 0}}
"""
    )


def container_file(harness: Harness, inventory: Path, rel: str) -> Path:
    return harness.container_path("200", f"/workspace/{inventory.parent.name}/{rel}")


def wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_restarts_happen_with_the_controller_away_and_status_learns_them(
    proxied_inventory: Path, proxy: LoopProxy, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = f"/workspace/{proxied_inventory.parent.name}"
    add_profiles(proxied_inventory, workspace)
    monkeypatch.setenv("WORKLOAD_SECRET", SECRET)
    code, out, err = cli("deploy", "--detach", "ct200", "--profile", "flaky", "--name", "rs", "--launcher", "tmux")
    assert code == 0 and "supervised in the target by pid" in err, err
    proxy.refuse = True  # the laptop is gone: nothing reaches the host from here on
    proxy.cut_all()
    final = container_file(harness, proxied_inventory, "runs/rs-r2/supervisor.json")
    wait_for(lambda: final.is_file() and json.loads(final.read_text())["state"] == "done")
    assert json.loads(final.read_text())["reason"] == "finished"
    proxy.refuse = False

    code, out, err = cli("status", "--target", "ct200", "--json")
    assert code == 0, err
    assert {r["name"]: r["state"] for r in json.loads(out)["runs"]} == {
        "rs": "crashed",
        "rs-r1": "crashed",
        "rs-r2": "finished",
    }
    code, out, _ = cli("runs", "show", "rs-r2", "--json")
    record = json.loads(out)
    assert record["parent"] == "rs-r1" and record["target"] == "ct200" and record["launcher"] == "tmux"
    assert record["note"].startswith("auto-restart after exit 1 at step 12: RuntimeError: injected crash")
    assert "secret present: True" in container_file(harness, proxied_inventory, "runs/rs-r2/train.log").read_text()
    for path in container_file(harness, proxied_inventory, "").rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_hung_run_is_stopped_and_stop_reaches_the_supervisor(inventory: Path, harness: Harness) -> None:
    add_profiles(inventory, f"/workspace/{inventory.parent.name}")
    assert cli("deploy", "--detach", "ct200", "--profile", "hung", "--name", "hr", "--launcher", "nohup")[0] == 0
    stall = container_file(harness, inventory, "runs/hr/stall.json")
    wait_for(lambda: stall.is_file(), timeout=60)
    info = json.loads(stall.read_text())
    assert (
        "no status.json heartbeat" in info["reason"] and 2.0 <= info["at"] - info["last_heartbeat"] <= 2.0 + 0.5 + 1.5
    )
    wait_for(
        lambda: (
            cli("status", "hr", "--json")[1]
            and json.loads(cli("status", "hr", "--json")[1])["runs"][0]["state"] == "crashed"
        ),
        timeout=30,
    )

    code, _, err = cli("deploy", "--detach", "ct200", "--profile", "flaky", "--name", "sv", "--launcher", "nohup")
    assert code == 0, err
    code, out, err = cli("stop", "sv", "--grace", "10")
    assert code == 0 and "no automatic restart will follow" in err, err
    time.sleep(1.5)  # longer than the backoff: a surviving supervisor would have restarted by now
    runs = container_file(harness, inventory, "runs")
    assert not (runs / "sv-r1").exists()
    assert json.loads((runs / "sv" / "supervisor.json").read_text())["state"] == "cancelled"
