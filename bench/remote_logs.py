"""Bench: `logs -f` latency, from a line written in the container to the follower having it.

A job in container 200 writes one line every 100 ms carrying its own time.time() (the container shares
the host's clock); the follower is `ops.control.read_log(..., follow=True)` over the proxy, the code
path of `dflashops logs -f` (one streaming `follow` agent call). Latency = arrival time - the time in the
line. Goal (issue 19, item 4): median <= 1 RTT + 30 ms at 0 and 50 ms added RTT.

Usage (root): .venv/bin/python bench/remote_logs.py [--lines 60]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from remote_common import harness_session, median, percentile, write_inventory

from dflashops.core.inventory import load_inventory
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import LogCursor, read_log
from dflashops.ops.runs.deploy import deploy
from dflashops.ops.runs.launch import DeployRequest

WRITER = (
    "import sys,time\nfor i in range(int(sys.argv[1])):\n    print(f'tick {i} {time.time():.6f}', flush=True)\n"
    "    time.sleep(0.1)\n"
)


def measure(inventory_path: Path, name: str, lines: int, poll_s: float) -> list[float]:
    inventory = load_inventory(inventory_path)
    invocation = Invocation(inventory)
    try:
        deploy(
            invocation,
            DeployRequest(target="ct200", profile="work", name=name, launcher="nohup", extra_args=[str(lines)]),
        )
        latencies: list[float] = []
        pending = ""
        for chunk in read_log(invocation, name, LogCursor(), target="ct200", follow=True, poll_s=poll_s, timeout=120):
            now = time.time()
            pending += chunk
            *complete, pending = pending.split("\n")
            latencies += [now - float(line.split()[2]) for line in complete if line.startswith("tick ")]
        return latencies[1:]  # the first line waits for the launch itself
    finally:
        invocation.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=60)
    args = parser.parse_args()
    with harness_session("bench-logs-") as (harness, proxy, folder):
        (folder / "writer.py").write_text(WRITER)
        inventory = write_inventory(folder, harness, proxy.port, ["writer.py"], ["{python}", "{release}/writer.py"])
        print("| added RTT | lines | median (ms) | p95 (ms) | goal: median <= RTT + 30 ms |")
        print("|---|---|---|---|---|")
        for index, rtt_ms in enumerate((0, 50)):
            proxy.latency_s = rtt_ms / 2000.0
            values = measure(inventory, f"logs-bench-{os.getpid()}-{index}", args.lines, 0.5)
            goal = "met" if median(values) * 1000 <= rtt_ms + 30 else "missed"
            print(
                f"| {rtt_ms} ms | {len(values)} | {median(values) * 1000:.0f} | "
                f"{percentile(values, 0.95) * 1000:.0f} | {goal} |"
            )


if __name__ == "__main__":
    main()
