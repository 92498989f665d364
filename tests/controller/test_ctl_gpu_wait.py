"""stop waits until the run's processes are gone from the GPU. There is no GPU on the test machine, so a
stand-in `nvidia-smi` on PATH (the one mock here: a fault we cannot produce for real) lists the run's pid
as a compute app until the test removes it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

from tests.controller.helpers import AGENT, WORKLOAD, Env

FAKE_SMI = """#!/bin/sh
case "$*" in
  *query-compute-apps*) cat "$FAKE_GPU_APPS" 2>/dev/null ;;
  *query-gpu*) echo "0, Fake H200, 4321, 143771, 97" ;;
esac
"""


def agent(verb: str, request: dict, path_env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, str(AGENT), verb, "--json-args", json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **path_env},
    )
    return json.loads(out.stdout)


def launch(env: Env, name: str, extra: dict[str, str]) -> int:
    answer = agent(
        "launch",
        {
            "workspace": str(env.workspace),
            "name": name,
            "launcher": "nohup",
            "argv": [sys.executable, str(WORKLOAD), "--output-dir", str(env.runs / name)],
        },
        extra,
    )
    assert answer["ok"], answer
    return env.job_pid(name)


def test_stop_waits_for_gpu_memory_release(env: Env, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    apps = tmp_path / "apps.csv"
    extra = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GPU_APPS": str(apps)}
    gpus = agent("gpus", {}, extra)
    assert gpus["available"] and gpus["gpus"][0]["memory_used_mib"] == 4321

    pid = launch(env, "held", extra)
    apps.write_text(f"{pid}, 5000\n")  # the driver still lists the dead process: memory not released
    answer = agent("stop", {"workspace": str(env.workspace), "name": "held", "grace": 5, "gpu_timeout": 1}, extra)
    assert answer["ok"] and answer["gpu_released"] is False and answer["seconds"] >= 1

    pid = launch(env, "freed", extra)
    apps.write_text(f"{pid}, 5000\n")
    timer = threading.Timer(0.7, apps.unlink)
    timer.start()
    answer = agent("stop", {"workspace": str(env.workspace), "name": "freed", "grace": 5, "gpu_timeout": 20}, extra)
    timer.join()
    assert answer["ok"] and answer["gpu_released"] is True and 0.3 <= answer["seconds"] < 20  # it did wait
