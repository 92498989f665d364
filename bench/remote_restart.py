"""Bench: the seed's hand chain vs `dflashops restart`, over a link with 50 ms added round-trip time.

Hand chain (three separate OpenSSH invocations, each a new connection, as typed in the seed incident):
    ssh host 'sudo pct exec 200 -- tmux kill-session -t dflash'
    ssh host 'sudo pct exec 200 -- sh -c "cat > .../workload.py"' < workload.py      (the scp step)
    ssh host 'sudo pct exec 200 -- tmux new-session -d -s dflash python3 .../workload.py ...'
dflashops: `dflashops restart RUN --name +` in a fresh process: one connection; container check; clean
stop (SIGTERM, wait until the group is gone); content-hashed sync of the changed file; new run dir,
run.json, lineage edge; launch. One file changes before every iteration in both arms.

Usage (root): .venv/bin/python bench/remote_restart.py [--iterations 5] [--rtt-ms 50] [--cold] [--no-pyc]
Prints a table; the goal is dflashops/hand <= 0.5. The ssh multiplexer is started by the deploy before the
loop (warm, a scripted cycle's steady state); --cold stops it before every restart (each connects itself
and starts a new one as it ends; the bench waits for that one before the next hand chain).
The CLI's .pyc files are cached in the scratch folder (as an installed CLI has them) even under
PYTHONDONTWRITEBYTECODE; --no-pyc compiles every module at every start, as a CLI does where that is set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

from remote_common import REPO, cli, harness_session, median, ssh_argv, stop_multiplexers, write_inventory

HAND_DIR = "/workspace/hand"


def hand_chain(ssh: list[str], workload: Path) -> float:
    started = time.monotonic()
    subprocess.run([*ssh, "sudo -n pct exec 200 -- tmux kill-session -t dflash"], capture_output=True)
    with workload.open("rb") as data:
        subprocess.run(
            [*ssh, f"sudo -n pct exec 200 -- sh -c 'mkdir -p {HAND_DIR} && cat > {HAND_DIR}/workload.py'"],
            stdin=data,
            check=True,
            capture_output=True,
        )
    subprocess.run(
        [
            *ssh,
            f"sudo -n pct exec 200 -- tmux new-session -d -s dflash python3 {HAND_DIR}/workload.py "
            f"--output-dir {HAND_DIR}/out --steps 100000 --interval 0.05",
        ],
        check=True,
        capture_output=True,
    )
    return time.monotonic() - started


def wait_for_multiplexer(folder: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not list(folder.glob("*.sock")) and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--cold", action="store_true", help="stop the ssh multiplexer before every restart")
    parser.add_argument(
        "--no-pyc",
        action="store_true",
        help="no bytecode cache for the CLI (honours PYTHONDONTWRITEBYTECODE: compiles at every start)",
    )
    args = parser.parse_args()
    with harness_session("bench-restart-", bytecode_cache=not args.no_pyc) as (harness, proxy, folder):
        workload = folder / "workload.py"
        shutil.copy(REPO / "tests" / "workloads" / "workload.py", workload)
        inventory = write_inventory(
            folder,
            harness,
            proxy.port,
            ["workload.py"],
            [
                "{python}",
                "{release}/workload.py",
                "--output-dir",
                "{run_dir}",
                "--steps",
                "100000",
                "--interval",
                "0.05",
            ],
        )
        cli(inventory, "deploy", "ct200", "--profile", "work", "--name", "bench-r1", "--wait", "^step 1 ")
        multiplexed = os.environ.get("DFLASHOPS_SSH_PERSIST", "").strip() not in ("0", "0.0")
        if multiplexed:
            wait_for_multiplexer(folder / "mux")  # the one the deploy started as it ended
        proxy.latency_s = args.rtt_ms / 2000.0  # per direction
        ssh = ssh_argv(harness, proxy.port)
        hand_times, ops_times = [], []
        current = "bench-r1"
        for iteration in range(args.iterations):
            with workload.open("a") as handle:
                handle.write(f"# change {iteration}\n")
            hand_times.append(hand_chain(ssh, workload))
            if args.cold:
                stop_multiplexers(folder / "mux")
            started = time.monotonic()
            result = cli(inventory, "restart", current, "--name", "+", "--grace", "30")
            ops_times.append(time.monotonic() - started)
            current = result.stdout.split()[0]
            if args.cold and multiplexed:  # the multiplexer it started as it ended: up before the next timed hand chain
                wait_for_multiplexer(folder / "mux")
        proxy.latency_s = 0.0
        cli(inventory, "stop", current, check=False)
        subprocess.run([*ssh, "sudo -n pct exec 200 -- tmux kill-session -t dflash"], capture_output=True)
        hand, ops = median(hand_times), median(ops_times)
        print(
            "| added RTT | iterations | hand chain median (s) | dflashops restart median (s) | ratio dflashops/hand |"
        )
        print("|---|---|---|---|---|")
        mode = ("no multiplexer" if not multiplexed else "cold multiplexer" if args.cold else "warm multiplexer") + (
            ", no .pyc" if args.no_pyc else ""
        )
        print(f"| {args.rtt_ms:g} ms ({mode}) | {args.iterations} | {hand:.3f} | {ops:.3f} | {ops / hand:.2f} |")
        print(f"hand chain runs: {', '.join(f'{t:.3f}' for t in hand_times)}")
        print(f"dflashops runs:  {', '.join(f'{t:.3f}' for t in ops_times)}")


if __name__ == "__main__":
    main()
