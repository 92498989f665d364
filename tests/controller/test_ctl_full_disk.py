"""A run whose workspace disk is full (a real tmpfs, filled to ENOSPC): `stop` still stops it, and the run's
end is still recorded (issue 15, items 1 and 7). Needs root for the mount."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import Env, cleanup
from tests.controller.test_ctl_reliability import SLEEPER, add_profile, state_of, wait_until


@pytest.fixture
def full_disk_env(env: Env) -> Iterator[Env]:
    """`env` with its workspace on an 8 MiB tmpfs of its own (unmounted at the end, after the runs stop)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    env.workspace.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(env.workspace)], check=True)
    (env.root / "sleeper.py").write_text(SLEEPER)
    add_profile(
        env,
        "sleeper",
        """
argv: ["{python}", "{release}/sleeper.py", "GO_FILE"]
files: [sleeper.py]
packages: []
""".replace("GO_FILE", str(env.root / "go")),
    )
    try:
        yield env
    finally:
        cleanup(env.workspace)
        if subprocess.run(["umount", str(env.workspace)]).returncode != 0:
            subprocess.run(["umount", "-l", str(env.workspace)], check=True)  # busy: detach it, never leak it


def fill(folder: Path) -> None:
    """Write zeros until the filesystem refuses: ENOSPC for real."""
    with open(folder / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == 28, exc
    with pytest.raises(OSError):
        (folder / "probe").write_bytes(b"x" * 8192)


def test_item1_stop_on_a_full_disk_still_stops_the_run(full_disk_env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    env = full_disk_env
    code, _, err = env.cli("deploy", "--profile", "sleeper", "--name", "full1", "--wait", "sleeping", capsys=capsys)
    assert code == 0, err
    job = env.job_pid("full1")
    fill(env.workspace)
    code, out, err = env.cli("stop", "full1", "--grace", "5", capsys=capsys)
    assert code == 0, err
    assert "Traceback" not in err and "exit_code=143" in out
    assert "could not write" not in err  # stop.json went into its reserve, then was rewritten in place
    assert not Path(f"/proc/{job}").exists(), "the run kept running"
    entry = state_of(env, "full1")
    assert entry["state"] == "stopped" and entry["exit_code"] == 143  # recorded in the blocks set aside at start
    assert not [p.name for p in (env.runs / "full1").iterdir() if ".tmp-" in p.name]


def test_item7_a_run_that_ends_on_a_full_disk_records_its_exit_code(
    full_disk_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    env = full_disk_env
    code, _, err = env.cli(
        "deploy", "--profile", "sleeper", "--name", "full7", "--launcher", "nohup", "--wait", "sleeping", capsys=capsys
    )
    assert code == 0, err
    fill(env.workspace)
    (env.root / "go").write_text("")  # the job exits 3 now
    wait_until(lambda: state_of(env, "full7")["state"] != "running")
    entry = state_of(env, "full7")
    assert entry["state"] == "crashed" and entry["exit_code"] == 3, entry["state"]
    assert not [p.name for p in (env.runs / "full7").iterdir() if ".tmp-" in p.name], "a temporary file was left"
    code, out, _ = env.cli("status", "full7", "--json", capsys=capsys)
    assert json.loads(out)["runs"][0]["state"] == "crashed"
