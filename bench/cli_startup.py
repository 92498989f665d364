"""What one `dflashops` call costs before it does anything (issue 46, item 7).

    .venv/bin/python bench/cli_startup.py            # 15 runs of each command, median
    .venv/bin/python bench/cli_startup.py -n 31 --json

Three commands, each run as a user types it (the `.venv/bin/dflashops` console script, a new process each time)
against a scratch inventory whose one target is `local` with an empty workspace, so `status` has nothing
running: `dflashops --help`, `dflashops status --help` and `dflashops status`. Each is timed with
PYTHONDONTWRITEBYTECODE unset and set to 1 (some machines set it for every process: then nothing the first call
compiles is kept, and only the .pyc files that exist already are read). One untimed run of each first, so the
page cache is warm. The load average is printed before and after: on a busy machine every number grows.

Goals (issue 46): `--help` and `status --help` <= 0.15 s, `status` with nothing running <= 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"--help": 0.15, "status --help": 0.15, "status": 0.3}


def inventory(folder: Path) -> Path:
    """A scratch inventory: the `local` target with an empty workspace (nothing running)."""
    path = folder / "inventory.yaml"
    path.write_text(f"targets:\n  local:\n    kind: local\n    workspace: ws\n    python: {sys.executable}\n")
    return path


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="runs of each command (default 15)")
    parser.add_argument("--json", action="store_true", help="the medians as JSON on stdout")
    parser.add_argument("--dflashops", default=str(ROOT / ".venv/bin/dflashops"), help="the console script")
    args = parser.parse_args()
    pyc_files = len(list((ROOT / "dflashops").rglob("*.pyc")))
    load_before = os.getloadavg()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="cli-startup-") as scratch:
        folder = Path(scratch)
        inv = inventory(folder)
        # PYTHONDONTWRITEBYTECODE first: run on a tree whose package has no .pyc files yet, it measures what a
        # fresh clone costs on a machine that sets it (nothing is ever cached); the second mode then writes them.
        for mode in ("PYTHONDONTWRITEBYTECODE=1", "bytecode written"):
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            if mode.startswith("PYTHONDONTWRITEBYTECODE"):
                env["PYTHONDONTWRITEBYTECODE"] = "1"
            results[mode] = {}
            for command in GOALS:
                argv = [args.dflashops, "--inventory", str(inv), *command.split()]
                timed(argv, env, folder)  # untimed: page cache (and, bytecode written, the .pyc files)
                runs = [timed(argv, env, folder) for _ in range(args.n)]
                results[mode][command] = statistics.median(runs)
    load_after = os.getloadavg()
    if args.json:
        report = {"medians_s": results, "load_before": load_before, "load_after": load_after, "n": args.n}
        print(json.dumps({**report, "package_pyc_files_before": pyc_files}))
        return 0
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; median of {args.n} runs each")
    print(f"the package's .pyc files before the first run: {pyc_files}")
    print(f"{'command':<16}" + "".join(f"{mode:>28}" for mode in results) + f"{'goal':>8}")
    for command, goal in GOALS.items():
        cells = "".join(f"{results[mode][command]:>27.3f}s" for mode in results)
        print(f"{command:<16}{cells}{goal:>7.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
