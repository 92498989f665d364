"""Shared set-up for bench/remote_*.py: the test harness (real sshd + pct stand-in) and a proxied inventory.

Run as root on a Debian machine (the harness creates a test user and a sudoers rule, removed at exit).
Every byte goes over 127.0.0.1 through `LoopProxy`, which adds latency and counts bytes per direction.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "remote"))
sys.path.insert(0, str(REPO))

import remote_harness  # noqa: E402
from loopproxy import LoopProxy  # noqa: E402

from dflashops.transport.mux_client import stop_multiplexers  # noqa: E402

PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable


@contextlib.contextmanager
def harness_session(
    prefix: str, ctids: tuple[str, ...] = ("200",), *, bytecode_cache: bool = True
) -> Iterator[tuple[remote_harness.Harness, LoopProxy, Path]]:
    """The loopback harness (sshd + pct stand-in with `ctids`), a latency proxy in front of it and a scratch
    folder; all three are torn down when the block ends, also on an error.

    bytecode_cache: the `dflashops` processes (CLI, multiplexer) keep their .pyc files in the scratch folder
    even where PYTHONDONTWRITEBYTECODE is set (it is on the CI VM): an installed CLI never compiles its
    modules at start-up, and with the variable set every start compiled ~40 of them (~0.1 s, more under
    load). The untimed deploy before a loop writes them. False: as before, every start compiles."""
    harness = remote_harness.start_harness()
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["DFLASHOPS_MUX_DIR"] = str(folder / "mux")  # this bench's ssh multiplexers, stopped at the end
    if bytecode_cache:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")  # not in the source tree; removed at the end
    proxy = None
    try:
        for ctid in ctids:
            harness.create_container(ctid, f"gpu{ctid}")
        proxy = LoopProxy(harness.port).start()
        harness.trust_port(proxy.port)
        yield harness, proxy, folder
    finally:
        if proxy is not None:
            proxy.close()
        if (folder / "mux").is_dir():
            stop_multiplexers(folder / "mux")
        harness.stop()
        shutil.rmtree(folder, ignore_errors=True)


def write_inventory(
    folder: Path,
    harness: remote_harness.Harness,
    port: int,
    files: list[str],
    argv: list[str],
    workspace: str = "/workspace/bench",
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "inventory.yaml"
    argv_yaml = ", ".join(f'"{a}"' for a in argv)
    files_yaml = ", ".join(files)
    path.write_text(
        textwrap.dedent(f"""\
        hosts:
          pve: {{address: 127.0.0.1, port: {port}, user: {harness.user}, identity_file: {harness.client_key},
                known_hosts: {harness.known_hosts}, sudo: true}}
        targets:
          ct200: {{kind: pct, host: pve, ctid: 200, workspace: {workspace}}}
        profiles:
          work:
            argv: [{argv_yaml}]
            files: [{files_yaml}]
        """)
    )
    return path


def ssh_argv(harness: remote_harness.Harness, port: int) -> list[str]:
    """The system OpenSSH client, as the seed's hand-typed commands used it (a new connection per call)."""
    return [
        "ssh",
        "-i",
        str(harness.client_key),
        "-o",
        f"UserKnownHostsFile={harness.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-p",
        str(port),
        f"{harness.user}@127.0.0.1",
    ]


def cli(inventory: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The real `dflashops` command in a fresh process (start-up and imports included in its time)."""
    env = {**os.environ, "DFLASHOPS_INVENTORY": str(inventory), "PYTHONPATH": str(REPO)}
    result = subprocess.run([PYTHON, "-m", "dflashops.cli.main", *args], capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise RuntimeError(f"dflashops {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median(values: list[float]) -> float:
    return statistics.median(values)
