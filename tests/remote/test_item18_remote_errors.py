"""Raw tracebacks and internal command dumps where a user needs one line (issue 15, item 18), remote half:
a container stopped while `logs -f` follows it, a missing identity file, a key file of garbage, and a
target python that does not exist in the container. Real sshd, real pct stand-in, the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, cli, write_inventory
from remote_harness import Harness


def assert_one_error(code: int, err: str, *words: str) -> None:
    assert code != 0, err
    assert "Traceback" not in err and "os.replace" not in err and "sys.stdin.buffer" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "hint:"))]
    assert [line.split(":")[0] for line in lines] == ["error", "hint"], err
    for word in words:
        assert word in err, (word, err)


def test_item18_container_stopped_during_logs_follow_says_so(tmp_path: Path, harness: Harness) -> None:
    harness.create_container("204", "gpu204")
    inventory = write_inventory(
        tmp_path / "inventory.yaml",
        harness,
        workspace=f"/workspace/{tmp_path.name}",
        extra_targets=f"ct204: {{kind: pct, host: pve, ctid: 204, workspace: /workspace/{tmp_path.name}}}\n",
    )
    code, _, err = cli(
        "--inventory",
        str(inventory),
        "deploy",
        "ct204",
        "--profile",
        "work",
        "--name",
        "cs-a1",
        "--wait",
        r"^step 1 ",
        "--timeout",
        "60",
    )
    assert code == 0, err
    follower = subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(inventory), "logs", "cs-a1", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        time.sleep(1.5)  # the follower has read some lines and is polling
        harness.pct("stop", "204")
        _, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()  # our own child, by pid
            follower.wait()
        harness.pct("start", "204", check=False)
    assert_one_error(follower.returncode, err, "container 204 on pve is stopped", "pct start 204")


def test_item18_missing_identity_file_names_the_file(tmp_path: Path, harness: Harness) -> None:
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, workspace=f"/workspace/{tmp_path.name}")
    missing = tmp_path / "no_such_key"
    inventory.write_text(inventory.read_text().replace(str(harness.client_key), str(missing)))
    code, _, err = cli("--inventory", str(inventory), "status", "--target", "ct200")
    assert_one_error(code, err, f"identity file {missing} does not exist (host pve)", "identity_file")


def test_item18_garbage_key_file_is_named_not_decoded(tmp_path: Path, harness: Harness) -> None:
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, workspace=f"/workspace/{tmp_path.name}")
    garbage = tmp_path / "garbage_key"
    garbage.write_bytes(os.urandom(2048))
    garbage.chmod(0o600)
    inventory.write_text(inventory.read_text().replace(str(harness.client_key), str(garbage)))
    code, _, err = cli("--inventory", str(inventory), "status", "--target", "ct200")
    assert_one_error(code, err, f"identity file {garbage} (host pve) is not a private key", "ssh-keygen")


def test_item18_missing_python_in_the_container_names_the_setting(tmp_path: Path, harness: Harness) -> None:
    inventory = write_inventory(
        tmp_path / "inventory.yaml",
        harness,
        workspace=f"/workspace/{tmp_path.name}",
        extra_targets="nopy: {kind: pct, host: pve, ctid: 200, workspace: "
        f"/workspace/{tmp_path.name}, python: /opt/none/bin/python3}}\n",
    )
    for verb in (
        ("status", "--target", "nopy"),
        ("deploy", "--detach", "nopy", "--profile", "work", "--name", "np-a1"),
    ):
        code, _, err = cli("--inventory", str(inventory), *verb)
        assert_one_error(code, err, "/opt/none/bin/python3 cannot be run in container 200", "`python:` of target nopy")
    assert not harness.container_path("200", f"/workspace/{tmp_path.name}/runs/np-a1").exists()
