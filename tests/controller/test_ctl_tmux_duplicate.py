"""A tmux launch that meets a session of the same name on the workspace's tmux server (issue 27, item 11c):
the agent refuses it before it takes the run's name (so the name stays free); the user gets one error line and
a hint that says where the session is, the exact command to look at it, and the ways around it. Real tmux, real
agent."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dflashops.agent.common import tmux_socket
from tests.controller.helpers import Env


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_a_duplicate_tmux_session_gets_a_hint(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    socket = tmux_socket(str(env.workspace))
    # Someone's own session on the workspace's server, under the name the run's session would have.
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "dup1", "sleep", "300"], check=True)
    code, out, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "dup1", "--launcher", "tmux", capsys=capsys
    )
    assert code == 4 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[-2].startswith("error: ") and "a tmux session named 'dup1' already exists" in lines[-2], err
    hint = lines[-1]
    assert hint.startswith("hint: ") and socket in hint, err
    assert f"tmux -L {socket} ls" in hint and "--launcher nohup" in hint and "--name" in hint, hint
    assert "dflashops exec local -- " in hint, hint  # the same look from here, for any kind of target
    listed = subprocess.run(["tmux", "-L", socket, "ls"], capture_output=True, text=True, check=True).stdout
    assert listed.startswith("dup1:")  # the session that was there is left alone

    assert not (env.runs / "dup1").exists()  # the name is still free: with nohup it launches under it
    code, out, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "dup1", "--launcher", "nohup", capsys=capsys
    )
    assert code == 0, err
    code, out, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "dup2", "--launcher", "tmux", capsys=capsys
    )
    assert code == 0, err  # another --name: another session, on the same server
