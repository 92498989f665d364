"""A run whose workspace disk is full (a real tmpfs, filled to ENOSPC): `stop` still stops it, and the run's
end is still recorded (issue 15, items 1 and 7). Needs root for the mount."""

from __future__ import annotations

import json
import os
import re
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


def test_a_deploy_onto_a_full_disk_is_one_error_and_leaves_nothing(
    full_disk_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 45 item 4: `error: local: OSError: [Errno 28] No space left on device` with no hint, and an empty run
    directory that showed as `launching`, later `lost`, and used the name up."""
    env = full_disk_env
    code, _, err = env.cli("deploy", "--profile", "sleeper", "--name", "dk0", "--wait", "sleeping", capsys=capsys)
    assert code == 0, err  # the release is synced; a restart below needs no new files
    fill(env.workspace)
    before = sorted(p.name for p in env.runs.iterdir())
    for argv in (
        ["deploy", "--profile", "sleeper", "--name", "dk2", "--wait", "sleeping"],
        ["restart", "dk0", "--name", "dk3", "--wait", "sleeping"],
    ):
        code, out, err = env.cli(*argv, capsys=capsys)
        lines = err.strip().splitlines()
        assert code != 0 and "Traceback" not in err, err
        error = next(line for line in lines if line.startswith("error: "))
        assert "no space left" in error.lower() and str(env.workspace) in error, err
        assert re.search(r"needs about \d+ MiB", error), err  # the space it needs
        assert lines[lines.index(error) + 1].startswith("hint: free space on the disk of "), err
        assert sorted(p.name for p in env.runs.iterdir()) == before, argv  # no run directory left behind
    assert state_of(env, "dk0")["state"] == "running"  # the restart never stopped the parent
    (env.root / "sleeper.py").write_text(SLEEPER + "\n# changed: a new release to upload\n")
    code, out, err = env.cli(
        "deploy", "--profile", "sleeper", "--name", "dk4", "--wait", "sleeping", capsys=capsys
    )  # fmt: skip
    assert code != 0 and "Traceback" not in err and "\nhint: free space on the disk of " in err, err
    assert sorted(p.name for p in env.runs.iterdir()) == before
    code, out, _ = env.cli("status", "--json", capsys=capsys)
    assert {run["name"] for run in json.loads(out)["runs"]} == {"dk0"}
    (env.workspace / "filler").unlink()  # space again: the names are free
    code, _, err = env.cli("deploy", "--profile", "sleeper", "--name", "dk2", "--wait", "sleeping", capsys=capsys)
    assert code == 0, err


def test_a_disk_that_fills_during_the_launch_gives_the_name_back(
    full_disk_env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Space enough by the up-front check, but the disk refuses the launch's own first records (out of inodes:
    the mkdir takes the last one, run.json finds none): the run directory just made is removed again."""
    env = full_disk_env
    code, _, err = env.cli("deploy", "--profile", "sleeper", "--name", "dn0", "--wait", "sleeping", capsys=capsys)
    assert code == 0, err
    stat = os.statvfs(env.workspace)
    subprocess.run(
        ["mount", "-o", f"remount,nr_inodes={stat.f_files - stat.f_ffree + 64}", str(env.workspace)], check=True
    )
    fillers = env.workspace / "inodes"
    fillers.mkdir()
    count = 0
    with pytest.raises(OSError) as refused:
        while True:
            (fillers / str(count)).touch()
            count += 1
    assert refused.value.errno == 28
    (fillers / "0").unlink()  # one inode left: the run directory's
    before = sorted(p.name for p in env.runs.iterdir())
    code, _, err = env.cli("deploy", "--profile", "sleeper", "--name", "dn1", "--wait", "sleeping", capsys=capsys)
    assert code != 0 and "Traceback" not in err, err
    assert "error: local: no space left on the disk of the workspace" in err and "no free inode" in err, err
    assert "\nhint: free space on the disk of " in err, err
    assert sorted(p.name for p in env.runs.iterdir()) == before  # the name was given back
    assert state_of(env, "dn0")["state"] == "running"
