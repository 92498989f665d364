"""Secrets stay out of run.json, the lineage database and dry-run output; sync is content-addressed,
incremental and atomic; --clear-cache removes only this code's compile cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.controller.helpers import Env, all_bytes

SECRET = "s3cr3t-9f8e7d6c5b4a-token"


def test_secret_reaches_the_run_but_no_record(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKLOAD_SECRET", SECRET)
    monkeypatch.setenv("WANDB_API_KEY", SECRET + "-wandb")
    code, out, err = env.cli("deploy", "--profile", "work", "--name", "sec", "--dry-run", capsys=capsys)
    assert code == 0 and "launch --json-stdin" in out and "<redacted>" in out
    assert SECRET not in out + err
    assert not env.workspace.exists() and not env.db.exists(), "dry-run changed something"
    code, out, err = env.cli("deploy", "--profile", "work", "--name", "sec", "--wait", "secret present", capsys=capsys)
    assert code == 0, err
    assert "secret present: True" in err  # the launched process got it through its environment
    assert env.cli("stop", "sec", "--grace", "5", capsys=capsys)[0] == 0
    run_json = json.loads((env.runs / "sec" / "run.json").read_text())
    assert run_json["env"]["WORKLOAD_SECRET"] == "<redacted>" and run_json["env"]["WANDB_API_KEY"] == "<redacted>"
    assert SECRET.encode() not in all_bytes(env.root), "a secret was written to disk"
    assert not (env.runs / "sec" / ".launch.json").exists()
    code, out, _ = env.cli("runs", "show", "sec", "--json", capsys=capsys)
    assert SECRET not in out


def release_of(env: Env, name: str) -> Path:
    return Path(json.loads((env.runs / name / "run.json").read_text())["release"])


def test_sync_is_incremental_and_flips_current(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "s1",
        "--launcher",
        "nohup",
        "--wait",
        "done",
        "--",
        "--steps",
        "1",
        capsys=capsys,
    )
    assert code == 0 and " 0 files uploaded" not in err
    first = release_of(env, "s1")
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "s2",
        "--launcher",
        "nohup",
        "--wait",
        "done",
        "--",
        "--steps",
        "1",
        capsys=capsys,
    )
    assert code == 0 and "0 files uploaded" in err and release_of(env, "s2") == first
    workload = env.root / "workload.py"
    workload.write_text(workload.read_text() + "\n# changed\n")
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "s3",
        "--launcher",
        "nohup",
        "--wait",
        "done",
        "--",
        "--steps",
        "1",
        capsys=capsys,
    )
    assert code == 0 and "1 files uploaded" in err
    second = release_of(env, "s3")
    assert second != first and first.is_dir(), "the previous release must stay for runs that use it"
    assert os.readlink(env.workspace / "releases" / "current") == second.name
    assert (second / "workload.py").read_text().endswith("# changed\n")
    assert (second / "dflashops_agent.py").stat().st_ino == (first / "dflashops_agent.py").stat().st_ino  # linked
    assert not [p for p in (env.workspace / "releases").iterdir() if p.name.startswith(".tmp-")]
    code, out, _ = env.cli("gc", "--keep", "1", "--run", "s1", capsys=capsys)
    assert code == 0 and json.loads(out)["removed_runs"] == ["s1"] and not (env.runs / "s1").exists()
    assert json.loads(out)["removed_releases"] == [first.name] and second.is_dir()


def test_clear_cache_removes_only_this_code_hash(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.deploy_one_step("c1", capsys) == 0
    code_hash = json.loads((env.runs / "c1" / "run.json").read_text())["code_hash"]
    mine = env.workspace / "cache" / "inductor" / code_hash
    other = env.workspace / "cache" / "inductor" / "0123456789abcdef"
    for folder in (mine, other):
        folder.mkdir(parents=True)
        (folder / "kernel.so").write_bytes(b"x")
    run_json = json.loads((env.runs / "c1" / "run.json").read_text())
    assert run_json["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(mine)
    assert (
        env.cli(
            "deploy",
            "--profile",
            "work",
            "--name",
            "c2",
            "--launcher",
            "nohup",
            "--clear-cache",
            "--wait",
            "done",
            "--",
            "--steps",
            "1",
            capsys=capsys,
        )[0]
        == 0
    )
    assert not mine.exists() and (other / "kernel.so").exists()
