"""Typed -> first step of `dflashops restart RUN --name NEW --resume` with unchanged code, on the local target
with the tiny CPU preset (issue 46 item 2: one import of torch on that path, not two).

    .venv/bin/python bench/restart_one_import.py                       # this checkout
    .venv/bin/python bench/restart_one_import.py --code /tmp/before    # another checkout's dflashops (before)

What it does, in a scratch folder: the trainer's own cold start (`python -m trainer train --preset tiny`
spawned -> its first step, status.json's `timeline`), then `deploy` of the tiny profile (the shipped inventory's
`tiny`, one torch thread) followed to its first step, then --repeats restarts in a chain, each typed -> the
child's first step. Prints one JSON line per measure and the medians; --code runs the controller (and so the
agent) of another checkout, the trainer's code being the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TRAINER_TEST_MIN_STEP_S": "0.1"}


def first_step(run_dir: Path, timeout: float) -> float:
    """The unix time of the run's first step (its status.json timeline), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            timeline = json.loads((run_dir / "status.json").read_text()).get("timeline") or {}
        except (OSError, ValueError):
            timeline = {}
        if "first_step" in timeline:
            return float(timeline["first_step"])
        time.sleep(0.1)
    raise SystemExit(f"{run_dir.name} took no step within {timeout:.0f} s (see {run_dir}/train.log)")


def cli(code: Path, inventory: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run(
        [sys.executable, "-m", "dflashops", "--inventory", str(inventory), *args], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dflashops {' '.join(args)} failed:\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose dflashops runs (default: this)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="restart-one-import-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load {os.getloadavg()[0]:.1f}, code {args.code}, in {work}", file=sys.stderr)
    own = work / "own"
    spawned = time.time()
    trainer = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", "--preset", "tiny", "--output-dir", str(own), "--max-steps", "3"],
        cwd=ROOT, env={**os.environ, **THREADS}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cold = first_step(own, 600) - spawned
    trainer.wait()
    print(json.dumps({"measure": "trainer cold start", "seconds": round(cold, 1)}), flush=True)
    inventory = work / "inventory.yaml"
    argv = ["{python}", "-m", "trainer", "train", "--preset", "tiny", "--output-dir", "{run_dir}"]
    inventory.write_text(
        json.dumps(
            {  # JSON is YAML; the shipped `local` target and `tiny` profile, with a run long enough to restart
                "targets": {"local": {"kind": "local", "workspace": str(work / "ws"), "python": sys.executable,
                                      "env": THREADS}},
                "profiles": {"tiny": {"argv": [*argv, "--max-steps", "100000", "--save-interval", "20"],
                                      "resume_args": ["--resume", "{checkpoint}"]}},
            }
        )
    )  # fmt: skip
    runs = work / "ws" / "runs"
    typed = time.time()
    cli(args.code, inventory, "deploy", "--profile", "tiny", "--name", "r0")
    print(json.dumps({"measure": "deploy", "seconds": round(first_step(runs / "r0", 600) - typed, 1)}), flush=True)
    seconds = []
    for index in range(1, args.repeats + 1):
        load = os.getloadavg()[0]
        typed = time.time()
        cli(args.code, inventory, "restart", f"r{index - 1}", "--name", f"r{index}", "--resume")
        seconds.append(first_step(runs / f"r{index}", 600) - typed)
        row = {"measure": "restart", "seconds": round(seconds[-1], 1), "load": round(load, 1)}
        print(json.dumps(row), flush=True)
    cli(args.code, inventory, "stop", f"r{args.repeats}", "--grace", "20")
    median = statistics.median(seconds)
    print(json.dumps({"median_restart_s": round(median, 1), "trainer_cold_s": round(cold, 1),
                      "ratio": round(median / cold, 2)}), flush=True)  # fmt: skip
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
