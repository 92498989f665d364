"""Helpers for controller tests: a throwaway inventory + workspace on the local target, the CLI run
in-process (fast) or as a real subprocess, and a teardown that stops every run the test started (by the
run's recorded process group, through the agent) and kills the workspace's own tmux server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflashops.agent.common import tmux_socket
from dflashops.agent.standby import retire_standbys, standbys
from dflashops.cli.main import main
from tests.tmux_screen import kill_server

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "tests" / "workloads" / "workload.py"
AGENT = REPO / "dflashops" / "agent"  # the package folder: python runs its __main__.py

INVENTORY = """\
targets:
  local:
    kind: local
    workspace: ws
    python: {python}
profiles:
  work:
    argv: ["{{python}}", "{{release}}/workload.py", --output-dir, "{{run_dir}}", --interval, "0.05"]
    files: [workload.py]
    packages: []
    resume_args: [--resume-from, "{{checkpoint}}"]
    pass_env: [WORKLOAD_SECRET]
    check: ["{{python}}", "{{release}}/workload.py", --output-dir, "{{run_dir}}", --check-only]
"""


@dataclass
class Env:
    root: Path
    inventory: Path
    workspace: Path

    @property
    def runs(self) -> Path:
        return self.workspace / "runs"

    @property
    def db(self) -> Path:
        return self.root / "lineage.sqlite"

    def job_pid(self, name: str, timeout: float = 30.0) -> int:
        """The pid of run `name`'s job. `launch` answers once the wrapper has recorded the group (`pgid`); the
        wrapper records `pid` only after it has started the job, and the job may print (and a `--wait` match)
        before that write, so a test reads it by waiting, never at once."""
        path = self.runs / name / "pid"
        deadline = time.monotonic() + timeout
        while True:
            try:
                return int(path.read_text())
            except (FileNotFoundError, ValueError):  # not written yet (write_atomic: never half-written)
                assert time.monotonic() < deadline, f"{path} was not written within {timeout:.0f} s"
                time.sleep(0.02)

    def cli(self, *args: str, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, str, str]:
        """dflashops in this process (fast); returns (exit code, stdout, stderr)."""
        assert capsys is not None
        capsys.readouterr()
        code = main(["--inventory", str(self.inventory), *args])
        out, err = capsys.readouterr()
        return code, out, err

    def deploy_one_step(self, name: str, capsys: pytest.CaptureFixture[str]) -> int:
        """`deploy --profile work` of a run that trains one step and finishes (nohup); its exit code."""
        return self.cli(
            "deploy", "--profile", "work", "--name", name, "--launcher", "nohup", "--wait", "done", "--", "--steps", "1",
            capsys=capsys,
        )[0]  # fmt: skip

    def run_cli(
        self, *args: str, extra_env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """dflashops as a real process, the way users and scripts call it."""
        env = {**os.environ, "PYTHONPATH": str(REPO), **(extra_env or {})}
        return subprocess.run(
            [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(self.inventory), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=self.root,
        )

    def agent(self, verb: str, request: dict) -> dict:
        out = subprocess.run(
            [sys.executable, str(AGENT), verb, "--json-args", json.dumps(request)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return json.loads(out.stdout)


def cleanup(workspace: Path) -> None:
    """Stop every still-running run of this workspace (only ours: by recorded pgid/marker), retire its
    standby interpreters (they exit by themselves once asked), then its tmux."""
    runs = workspace / "runs"
    for run in sorted(runs.iterdir()) if runs.is_dir() else []:
        if not (run / "pgid").exists():  # never launched (made by the test, or refused): the agent's stop would
            continue  # wait its launch-settle time for a start that cannot come (30 s of teardown each)
        subprocess.run(
            [
                sys.executable,
                str(AGENT),
                "stop",
                "--json-args",
                json.dumps({"workspace": str(workspace), "name": run.name, "grace": 1}),
            ],
            capture_output=True,
            timeout=60,
        )
    retire_standbys(str(workspace), keep=None)
    deadline = time.monotonic() + 10
    while standbys(str(workspace)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if shutil.which("tmux"):
        kill_server(tmux_socket(str(workspace)))  # this workspace's own server and socket, nothing else


def all_bytes(root: Path) -> bytes:
    """Every regular file under `root`, concatenated: where a secret must never turn up."""
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink())
