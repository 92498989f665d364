"""What a sync may ship and how it fails (issue 15, items 17 and 18, local half): files reached through a
symlink that leads outside the folder are refused; an unreadable file, a file deleted while the release is
built, and a target python that cannot be executed are each one `error:` line with a `hint:`, and nothing
is launched. Real files, real symlinks, real permissions (root's override dropped with setpriv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dflashops.ops.releases.sync as sync_module
from tests.controller.helpers import REPO, Env

NO_OVERRIDE = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]


def with_files(env: Env, *files: str) -> None:
    """The `work` profile ships these files besides workload.py."""
    text = env.inventory.read_text()
    env.inventory.write_text(text.replace("files: [workload.py]", f"files: [workload.py, {', '.join(files)}]", 1))


def assert_refused(code: int, err: str, *words: str) -> None:
    assert code != 0 and "Traceback" not in err, err
    # the verb's progress lines (a phase as it starts, e.g. "syncing the code to local") may come first; the
    # refusal itself is exactly one error line and one hint line, last
    lines = err.strip().splitlines()
    assert [line.split(":")[0] for line in lines[-2:]] == ["error", "hint"], err
    assert not [line for line in lines[:-2] if line.startswith(("error", "hint", "warning"))], err
    for word in words:
        assert word in err, (word, err)


def test_item17_a_symlinked_folder_leading_outside_is_refused(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    (env.root / "rootlink").symlink_to("/")
    with_files(env, "rootlink/etc/passwd")
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "work", "--name", "sl-a1", capsys=capsys)
    assert_refused(
        code,
        err,
        "profile file 'rootlink/etc/passwd' is /etc/passwd through a symlink",
        f"outside {env.root.resolve()}",
    )
    assert not (env.workspace / "releases").exists() and not (env.runs / "sl-a1").exists()


def test_item17_a_symlinked_file_leading_outside_is_refused(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("elsewhere") / "secret.txt"
    outside.write_text("not for the target\n")
    (env.root / "config.txt").symlink_to(outside)
    with_files(env, "config.txt")
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "work", "--name", "sl-a2", capsys=capsys)
    assert_refused(code, err, f"is {outside} through a symlink")
    assert not (env.workspace / "releases").exists()


def test_item17_a_symlink_that_stays_inside_is_shipped(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    (env.root / "data").mkdir()
    (env.root / "data" / "real.txt").write_text("inside\n")
    (env.root / "alias").symlink_to("data")
    with_files(env, "alias/real.txt")
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "work", "--name", "sl-a3", capsys=capsys)
    assert code == 0, err
    assert (env.workspace / "releases" / "current" / "alias" / "real.txt").read_text() == "inside\n"


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"),
    reason="needs root's permission override dropped with setpriv to make a file unreadable",
)
def test_item18_an_unreadable_file_in_the_tree_is_one_error_line(env: Env) -> None:
    secret = env.root / "data.txt"
    secret.write_text("unreadable\n")
    secret.chmod(0)
    with_files(env, "data.txt")
    done = subprocess.run(
        [
            *NO_OVERRIDE,
            sys.executable,
            "-m",
            "dflashops.cli.main",
            "--inventory",
            str(env.inventory),
            "deploy",
            "--detach",
            "local",
            "--profile",
            "work",
            "--name",
            "ur-a1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=env.root,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert_refused(done.returncode, done.stderr, f"cannot read {secret}: Permission denied", "chmod u+r")
    assert not (env.runs / "ur-a1").exists()


def test_item18_a_file_deleted_while_the_release_is_built(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race (an editor or a build removing a file between listing and reading) cannot be hit on purpose
    from outside, so the listing step is wrapped to delete a real file right after it was listed."""
    doomed = env.root / "doomed.txt"
    doomed.write_text("here a moment ago\n")
    with_files(env, "doomed.txt")
    real_listing = sync_module.release_files

    def listing_then_delete(*args: object, **kwargs: object) -> dict[str, Path]:
        files = real_listing(*args, **kwargs)  # type: ignore[arg-type]
        doomed.unlink()
        return files

    monkeypatch.setattr(sync_module, "release_files", listing_then_delete)
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "work", "--name", "gone-a1", capsys=capsys)
    assert_refused(code, err, f"{doomed} disappeared while the release was being built", "run the command again")
    assert not (env.runs / "gone-a1").exists()


def test_item18_a_local_python_that_is_not_executable(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_program = env.root / "python-notes.txt"
    not_a_program.write_text("this is not a program\n")
    env.inventory.write_text(env.inventory.read_text().replace(f"python: {sys.executable}", f"python: {not_a_program}"))
    code, _, err = env.cli("status", capsys=capsys)
    assert_refused(code, err, f"the target's python {not_a_program} cannot be run on local", "`python:` of target")
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "work", "--name", "px-a1", capsys=capsys)
    assert_refused(code, err, "cannot be run on local")
    assert not (env.runs / "px-a1").exists()
