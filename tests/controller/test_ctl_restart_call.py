"""The agent's one-call `restart` on the local target: secrets stay on stdin/env, and every refusal comes
before anything changed (old run still running, `current` unchanged, no new run dir, no new release)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflashops.agent.protocol import wire
from dflashops.ops.releases.sync import install_payload, local_manifest, release_files
from tests.controller.helpers import AGENT, Env, all_bytes

SECRET = "s3cr3t-restart-5a4b3c2d1e-token"


def test_restart_passes_secrets_only_through_stdin_and_env(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKLOAD_SECRET", SECRET)
    assert (
        env.cli(
            "deploy",
            "--profile",
            "work",
            "--name",
            "rs-v1",
            "--launcher",
            "nohup",
            "--wait",
            "secret present",
            capsys=capsys,
        )[0]
        == 0
    )
    code, out, err = env.cli("restart", "rs-v1", "--dry-run", capsys=capsys)
    assert code == 0 and " restart  < request JSON: " in out and "<redacted>" in out
    assert SECRET not in out + err
    code, out, err = env.cli("restart", "rs-v1", "--grace", "5", "--wait", "secret present", capsys=capsys)
    assert code == 0 and out.strip() == "rs-v2", err
    assert "secret present: True" in err  # the relaunched process got it through its environment
    assert env.cli("stop", "rs-v2", "--grace", "5", capsys=capsys)[0] == 0
    assert json.loads((env.runs / "rs-v2" / "run.json").read_text())["env"]["WORKLOAD_SECRET"] == "<redacted>"
    assert SECRET.encode() not in all_bytes(env.root), "a secret was written to disk"


def call_restart(request: dict, tar: bytes) -> dict:
    out = subprocess.run(
        [sys.executable, str(AGENT), "restart"],
        input=json.dumps(request).encode() + b"\n" + tar,
        capture_output=True,
        timeout=60,
    )
    lines = out.stdout.decode().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_agent_restart_refuses_before_changing_anything(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        env.cli(
            "deploy", "--profile", "work", "--name", "ref-v1", "--launcher", "nohup", "--wait", "step 1", capsys=capsys
        )[0]
        == 0
    )
    releases = env.workspace / "releases"
    current, before = os.readlink(releases / "current"), sorted(p.name for p in releases.iterdir())
    workload = env.root / "workload.py"
    workload.write_text(workload.read_text() + "# a change\n")
    files = release_files(("workload.py",), env.root, packages=())
    code_hash, manifest = local_manifest(files)
    base_files = json.loads((releases / current / ".manifest.json").read_text())
    payload = install_payload(str(env.workspace), files, code_hash, manifest, current, base_files)
    install, upload = wire(payload.request), payload.tar
    tar = upload.read_bytes()
    request = {
        "workspace": str(env.workspace),
        "old": "ref-v1",
        "name": "ref-v2",
        "argv": ["true"],
        "launcher": "nohup",
        "grace": 5,
        "install": install,
        "tar_bytes": len(tar),
        "env": {},
    }
    stale = install_payload(str(env.workspace), files, code_hash, manifest, "00000000deadbeef", base_files)
    cases = [
        ({**request, "tar_bytes": len(tar) + 1}, tar, "incomplete"),  # the upload was cut short
        (request, tar[: len(tar) // 2], "incomplete"),  # the connection was cut mid-upload
        (
            {**request, "install": wire(stale.request)},
            stale.tar.read_bytes(),
            "stale_release",
        ),  # the cached base is not there
        ({**request, "name": "ref-v1"}, tar, "conflict"),  # the new run's directory is taken
        ({**request, "old": "ghost"}, tar, "not_found"),
        ({**request, "argv": []}, tar, "bad_request"),
    ]
    for bad, payload, code in cases:
        answer = call_restart(bad, payload)
        assert answer["ok"] is False and answer["code"] == code, answer
        assert os.readlink(releases / "current") == current
        assert sorted(p.name for p in releases.iterdir()) == before
        assert not (env.runs / "ref-v2").exists()
        assert env.agent("status", {"workspace": str(env.workspace), "name": "ref-v1"})["runs"][0]["state"] == "running"
    answer = call_restart(request, tar)  # the same request, complete: stop + install + launch
    assert answer["ok"] is True and answer["release"] == code_hash and answer["stop"]["exit_code"] is not None
    assert os.readlink(releases / "current") == code_hash and answer["old_status"]["state"] == "stopped"
    assert (releases / code_hash / "workload.py").read_bytes() == workload.read_bytes()
