"""`dflashops attach` on a pct target: a real terminal (a local tmux pane) reaches the run's tmux session in
the container through the system ssh client -> sudo pct -> the container, and leaving it does not touch the run."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from conftest import cli

from dflashops.core.inventory import load_inventory
from dflashops.core.shell import join_argv
from dflashops.transport.interactive import interactive_argv
from tests.tmux_screen import Screen

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not shutil.which("tmux") or not shutil.which("ssh"), reason="needs tmux and ssh")


def test_attach_argv_checks_host_keys_and_goes_through_pct(inventory: Path) -> None:
    inv = load_inventory(inventory)
    argv = interactive_argv(
        inv.target("ct200"), ["tmux", "attach-session", "-t", "=a b"], hosts=inv.hosts, env={"TERM": "xterm"}
    )
    assert argv[:2] == ["ssh", "-t"] and "StrictHostKeyChecking=yes" in argv and "BatchMode=yes" in argv
    assert argv[-2] == "--" and argv[-1] == "sudo -n pct exec 200 -- env TERM=xterm tmux attach-session -t '=a b'"


def test_attach_shows_the_remote_session_and_leaving_keeps_the_run(inventory: Path) -> None:
    code, _, err = cli(
        "deploy",
        "ct200",
        "--profile",
        "work",
        "--name",
        "att1",
        "--launcher",
        "tmux",
        "--wait",
        r"step 3\b",
        "--timeout",
        "60",
    )
    assert code == 0, err
    socket = f"dfo-attach-test-{os.getpid()}"  # this test's own tmux server, removed by exact socket name
    env = {"DFLASHOPS_INVENTORY": str(inventory), "PYTHONPATH": str(REPO), "TERM": "xterm"}
    # The pane lingers after attach exits, so a failure leaves its error on the screen for the assertion.
    command = join_argv(
        ["sh", "-c", f"{sys.executable} -m dflashops attach att1 --target ct200; echo attach-exit=$?; sleep 60"]
    )
    screen = Screen(socket, command, width=160, height=40, env=env)
    try:
        shown, deadline = "", time.monotonic() + 30
        while time.monotonic() < deadline and "step " not in shown:
            time.sleep(0.5)
            shown = screen.text()
        assert "step " in shown, shown  # the run's pane, mirrored from inside the container
    finally:
        screen.close()
    time.sleep(1.0)
    code, out, err = cli("status", "att1", "--target", "ct200", "--json")
    assert code == 0, err
    assert [r["state"] for r in json.loads(out)["runs"]] == ["running"]  # detaching never stops the run
    assert cli("stop", "att1", "--target", "ct200", "--grace", "5")[0] == 0
