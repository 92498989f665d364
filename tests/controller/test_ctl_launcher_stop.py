"""A run whose job is a launcher (torchrun's part): the launcher forwards a SIGTERM to its worker and SIGKILLs
the worker after its shutdown timeout, which is shorter than the worker's final checkpoint. `stop` must
signal the worker that status.json names first, so the checkpoint is written. Real processes: a launcher
script that behaves like torchrun (forward, wait 1 s, SIGKILL; exit 1 when the worker failed) and a worker
that needs 2 s to checkpoint after SIGTERM."""

from __future__ import annotations

import pytest

from tests.controller.helpers import Env

LAUNCHER = """\
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
def forward(signum, frame):
    worker.send_signal(signum)
    time.sleep(1.0)           # torchrun: --shutdown-timeout (30 s by default), here 1 s
    worker.kill()
    sys.exit(1)
signal.signal(signal.SIGTERM, forward)
sys.exit(0 if worker.wait() == 0 else 1)
"""

WORKER = """\
import json, os, signal, sys, time
run_dir = sys.argv[1]
def stop(signum, frame):
    print("SIGTERM: checkpoint", flush=True)
    time.sleep(2.0)           # the final checkpoint takes longer than the launcher's shutdown timeout
    open(os.path.join(run_dir, "checkpoint-written"), "w").close()
    json.dump({"phase": "stopped", "pid": os.getpid()}, open(os.path.join(run_dir, "status.json"), "w"))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
json.dump({"phase": "training", "pid": os.getpid()}, open(os.path.join(run_dir, "status.json"), "w"))
print("step 1", flush=True)
while True:
    time.sleep(0.05)
"""


def test_stop_signals_the_worker_a_launcher_stands_in_front_of(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    (env.root / "launcher.py").write_text(LAUNCHER)
    (env.root / "worker.py").write_text(WORKER)
    env.inventory.write_text(
        env.inventory.read_text()
        + """\
  launched:
    argv: ["{python}", "{release}/launcher.py", "{release}/worker.py", "{run_dir}"]
    files: [launcher.py, worker.py]
    packages: []
"""
    )
    code, _, err = env.cli(
        "deploy", "--profile", "launched", "--name", "tr1", "--wait", "^step 1", "--timeout", "30", capsys=capsys
    )
    assert code == 0, err
    code, out, err = env.cli("stop", "tr1", "--grace", "20", capsys=capsys)
    assert code == 0, err
    assert (env.runs / "tr1" / "checkpoint-written").exists(), "the launcher killed the worker mid-checkpoint"
    code, out, _ = env.cli("status", "tr1", "--json", capsys=capsys)
    assert '"state": "stopped"' in out
