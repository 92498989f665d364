"""`dflashops fetch` into a folder whose disk fills up (issue 27, item 7), on a REAL full disk: a small
tmpfs of the test's own (needs root for the mount; skipped with that reason otherwise). The fetch ends with
one `error:` line and a `hint:`, keeps the partial file and its record, and the next fetch, once there is
room, continues from the bytes kept."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.controller.test_ctl_full_disk import fill
from tests.controller.test_fetch_local import CKPT_BYTES, finished_run, sha


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A fresh 1 MiB tmpfs (smaller than the run's 3 MB checkpoint file); unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_fetch_onto_a_full_disk_keeps_the_partial_and_continues_later(
    env: Env, capsys: pytest.CaptureFixture[str], small_disk: Path
) -> None:
    run = finished_run(env, capsys, "full")
    source = run / "checkpoints/step_000006/model.bin"
    dest = small_disk / "here"
    code, out, err = env.cli("fetch", "full", "--to", str(dest), capsys=capsys)
    assert code == 1 and out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    error = [line for line in lines if line.startswith("error: ")]
    hint = [line for line in lines if line.startswith("hint: ")]
    assert len(error) == 1 and len(hint) == 1 and lines[-2:] == error + hint, err
    partial = dest / "checkpoints/step_000006/.model.bin.partial"
    kept = partial.stat().st_size
    assert 0 < kept < CKPT_BYTES
    assert "checkpoints/step_000006/model.bin" in error[0] and "disk is full" in error[0], error
    assert f"{kept:,} of {CKPT_BYTES:,} bytes" in error[0], error
    assert "--to" in hint[0] and "continues" in hint[0], hint
    record = json.loads((dest / "checkpoints/step_000006/.model.bin.partial.json").read_text())
    assert record["sha256"] == sha(source)  # names the content, so the next fetch continues it
    assert partial.read_bytes() == source.read_bytes()[:kept]
    assert not (dest / "checkpoints/step_000006/model.bin").exists()

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # room made
    code, out, err = env.cli("fetch", "full", "--to", str(dest), "--json", capsys=capsys)
    assert code == 0, err
    model = next(f for f in json.loads(out)["files"] if f["path"].endswith("model.bin"))
    assert model["how"] == "resumed" and model["sent"] == CKPT_BYTES - kept
    assert hashlib.sha256((dest / "checkpoints/step_000006/model.bin").read_bytes()).hexdigest() == sha(source)
    assert not list(dest.rglob(".*partial*"))


def test_fetch_onto_a_disk_full_from_the_start_leaves_no_empty_partial(
    env: Env, capsys: pytest.CaptureFixture[str], small_disk: Path
) -> None:
    finished_run(env, capsys, "full0")
    dest = small_disk / "here"
    dest.mkdir()
    fill(small_disk)
    code, out, err = env.cli("fetch", "full0", "--to", str(dest), capsys=capsys)
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith("error: run.json: the local disk is full at ") and "none of its" in err, err
    assert "\nhint: free space on that disk" in err, err
    assert not list(dest.rglob("*")), "an empty partial or record was left, holding space"
    (small_disk / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    code, out, err = env.cli("fetch", "full0", "--to", str(dest), capsys=capsys)
    assert code == 0, err
