"""Which of Inductor's settings differ between a fresh `python -m trainer` and a standby interpreter (dflashops/agent/standby.py)?

Each side imports what it would (the fresh one with the run's whole environment; the standby the agent's
STANDBY_PRELOAD under the agent's start-up environment, then the run's environment on top), then the trainer's
modules, and prints Inductor's portable config; the differences go to stdout. bench/results/restart.md 2026-12-02 "The edit -> restart loop through the CLI" found the two keyed
their compile-cache entries apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DUMP = r"""
import importlib, json, os, sys
if sys.argv[1] == "standby":
    for name in PRELOAD:
        module, _, attribute = name.partition(":")
        imported = importlib.import_module(module)
        if attribute:
            getattr(imported, attribute)
    os.environ.clear()
    os.environ.update(RUN_ENV)
import trainer.train, trainer.training.loop, trainer.pipeline_run
import torch._inductor.config as c
print(json.dumps({k: repr(v) for k, v in sorted(c.save_config_portable().items())}))
"""


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from dflashops.agent.standby import STANDBY_PRELOAD, standby_start_env

    run_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = DUMP.replace("PRELOAD", repr(STANDBY_PRELOAD)).replace("RUN_ENV", repr(run_env))
    fresh = subprocess.run([sys.executable, "-c", code, "fresh"], env=run_env, capture_output=True, text=True)
    standby = subprocess.run(
        [sys.executable, "-c", code, "standby"], env=standby_start_env(run_env, []), capture_output=True, text=True
    )
    a, b = json.loads(fresh.stdout or "{}"), json.loads(standby.stdout or "{}")
    if not a or not b:
        print(fresh.stderr[-2000:], standby.stderr[-2000:])
        return 1
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    print(f"{len(diff)} of {len(a)} Inductor settings differ (fresh, standby): {json.dumps(diff)}")
    names = sorted(k for k in os.environ if k not in standby_start_env(run_env, []))
    print(f"names of this environment a standby does not start with: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
