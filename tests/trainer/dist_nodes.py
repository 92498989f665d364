"""Nodes of a distributed tiny run for tests: one real torchrun per node on 127.0.0.1, gloo, the CPU.

Each node is its own `torchrun --nnodes N --node-rank R --master-addr 127.0.0.1 --master-port P
--nproc-per-node 1 -m trainer train ...` process, with its own run directory and log file, as two containers
would run it. GLOO_SOCKET_IFNAME=lo keeps every connection on the loopback interface. Processes are started in
their own session; `stop_all` ends only the processes these helpers started (the torchrun process groups, and
each worker, which torchrun starts in a session of its own, by the pid its status.json records).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--preset",
    "tiny",
    "--wandb",
    "off",
    "--synthetic-samples",
    "48",
    "--log-interval",
    "1",
    "--save-interval",
    "1000",
    "--target-gpus",
    "cpu",
    "--drafter-gpus",
    "cpu,cpu",
    "--dist-timeout",
    "20",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


@dataclass
class Node:
    rank: int
    run_dir: Path
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def worker_pid(self) -> int | None:
        try:
            return int(self.status()["pid"])
        except (OSError, ValueError, KeyError):
            return None


def start_nodes(
    root: Path,
    args: list[str],
    *,
    nodes: int = 2,
    name: str = "run",
    per_node: dict[int, list[str]] | None = None,
    code_dirs: dict[int, Path] | None = None,
) -> list[Node]:
    """Start `nodes` torchrun processes (one per node) on a fresh port; node r trains into root/name/node-r.
    `per_node[r]`: extra flags for node r; `code_dirs[r]`: the checkout node r runs the trainer from."""
    port = free_port()
    started = []
    for rank in range(nodes):
        code = (code_dirs or {}).get(rank, REPO)
        run_dir = root / name / f"node-{rank}"
        log_path = root / f"{name}-node-{rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        argv = [
            *_torchrun(),
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--nproc-per-node",
            "1",
            "-m",
            "trainer",
            "train",
            *TINY,
            "--nodes",
            str(nodes),
            "--output-dir",
            str(run_dir),
            *args,
            *(per_node or {}).get(rank, []),
        ]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                cwd=code,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(Node(rank, run_dir, log_path, proc))
    return started


def wait_all(nodes: list[Node], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    for node in nodes:
        node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return [node.proc.returncode for node in nodes]


def wait_for_metrics(node: Node, lines: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and node.proc.poll() is None:
        if len(node.metrics()) >= lines:
            return
        time.sleep(0.1)
    raise AssertionError(
        f"node {node.rank} has no {lines} metrics lines (exit {node.proc.poll()}):\n{node.log()[-3000:]}"
    )


def stop_all(nodes: list[Node]) -> None:
    """Kill what is left of these nodes: each torchrun's process group, then each worker by its recorded pid
    (checked to be a trainer of this run directory first)."""
    for node in nodes:
        if node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(10)
        pid = node.worker_pid()
        if pid is None:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(node.run_dir).encode() in cmdline:
            os.kill(pid, signal.SIGKILL)
