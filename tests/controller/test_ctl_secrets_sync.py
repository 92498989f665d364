"""Secrets stay out of run.json, the lineage database and dry-run output; sync is content-addressed,
incremental and atomic; --clear-cache removes the compile caches and nothing else."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.controller.helpers import Env, all_bytes

SECRET = "s3cr3t-9f8e7d6c5b4a-token"
AGENT_FILE = "dflashops/agent/common.py"  # the agent in a release: its package, as the trainer's


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
    assert (second / AGENT_FILE).stat().st_ino == (first / AGENT_FILE).stat().st_ino  # linked
    assert not [p for p in (env.workspace / "releases").iterdir() if p.name.startswith(".tmp-")]
    code, out, _ = env.cli("gc", "--keep", "1", "--run", "s1", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["removed_runs"] == ["s1"] and not (env.runs / "s1").exists()
    assert json.loads(out)["removed_releases"] == [first.name] and second.is_dir()


def test_clear_cache_removes_the_compile_caches_and_nothing_else(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """One compile cache per target, shared by every code version (trainer/core/compile_cache.py names its folder
    inside); --clear-cache empties it (and a cache of the old per-code-hash layout) and says how much went."""
    assert env.deploy_one_step("c1", capsys) == 0
    run_json = json.loads((env.runs / "c1" / "run.json").read_text())
    assert run_json["env"]["TRAINER_COMPILE_CACHE_ROOT"] == str(env.workspace / "cache" / "compile")
    assert "TORCHINDUCTOR_CACHE_DIR" not in run_json["env"]  # no longer one per code hash
    shared = env.workspace / "cache" / "compile" / "py3.11-torch2.13.0-triton3.9.0-cpu"
    legacy = env.workspace / "cache" / "inductor" / "0123456789abcdef"
    for folder in (shared, legacy):
        folder.mkdir(parents=True)
        (folder / "kernel.so").write_bytes(b"x" * 1000)
    keep = env.workspace / "cache" / "other-tool" / "keep.bin"
    keep.parent.mkdir(parents=True)
    keep.write_bytes(b"mine")
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "c2", "--launcher", "nohup", "--clear-cache", "--wait", "done",
        "--", "--steps", "1", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "cleared the compile caches of local: 2.0 KiB in 2 files" in err
    assert not shared.exists() and not legacy.exists() and keep.read_bytes() == b"mine"
    assert (env.runs / "c1").is_dir() and (env.workspace / "releases").is_dir()
