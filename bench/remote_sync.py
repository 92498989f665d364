"""Bench: bytes on the wire for a code sync of a 300-file tree, dflashops vs rsync, through the proxy.

Cases: (a) nothing changed, (b) one 4 KiB file changed. dflashops: `ops.sync.sync` on an open Invocation
(connection, container check and agent already there: what is measured is the sync itself, i.e. the
`manifest` call and, when needed, the `install` call with its tar). rsync: `rsync -e ssh
--rsync-path="sudo -n pct exec 200 -- rsync"` into the container, a new ssh connection per run as rsync
always makes; its own `--stats` figures (protocol bytes, no ssh) are shown next to the proxy's count.

Usage (root, rsync installed): .venv/bin/python bench/remote_sync.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from remote_common import harness_session, write_inventory

from dflashops.core.inventory import load_inventory
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases.sync import release_files, sync

FILES = 300
FILE_BYTES = 4096


def make_tree(folder: Path) -> list[str]:
    names = []
    for index in range(FILES):
        rel = f"tree/mod{index // 50}/file_{index:03d}.py"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(os.urandom(FILE_BYTES // 2).hex().encode())
        names.append(rel)
    return names


def dflashops_sync(inventory_path: Path, proxy) -> tuple[int, int, int]:
    inventory = load_inventory(inventory_path)
    invocation = Invocation(inventory)
    try:
        agent = invocation.agent(inventory.target("ct200"))
        agent.ensure()
        proxy.reset_counters()
        outcome = sync(agent, extra_files=inventory.profile("work").files, extra_root=inventory.root)
        return proxy.bytes_up, proxy.bytes_down, len(outcome.uploaded)
    finally:
        invocation.close()


def rsync_run(source: Path, ssh: str, proxy) -> tuple[int, int, int]:
    proxy.reset_counters()
    result = subprocess.run(
        [
            "rsync",
            "-a",
            "--stats",
            "-e",
            ssh,
            "--rsync-path",
            "sudo -n pct exec 200 -- rsync",
            f"{source}/",
            "dfotest@127.0.0.1:/workspace/bench-rsync/",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    sent = int(re.search(r"Total bytes sent: ([\d,]+)", result.stdout).group(1).replace(",", ""))
    return proxy.bytes_up, proxy.bytes_down, sent


def main() -> None:
    if not shutil.which("rsync"):
        raise SystemExit("rsync is needed for the baseline: apt-get install -y rsync")
    with harness_session("bench-sync-") as (harness, proxy, folder):
        names = make_tree(folder)
        inventory = write_inventory(folder, harness, proxy.port, names, ["{python}", "-c", "pass"])
        ssh = (
            f"ssh -i {harness.client_key} -o UserKnownHostsFile={harness.known_hosts} -o BatchMode=yes "
            f"-o StrictHostKeyChecking=yes -p {proxy.port}"
        )
        harness.in_container("200", "mkdir", "-p", "/workspace/bench-rsync")
        total_files = len(release_files(tuple(names), folder))
        rows = []
        dflashops_sync(inventory, proxy)  # first full upload (not measured)
        rsync_run(folder, ssh, proxy)
        rows.append(("nothing changed", dflashops_sync(inventory, proxy), rsync_run(folder, ssh, proxy)))
        (folder / names[123]).write_bytes(os.urandom(FILE_BYTES // 2).hex().encode())
        rows.append(("one 4 KiB file changed", dflashops_sync(inventory, proxy), rsync_run(folder, ssh, proxy)))
        print(
            f"tree: {total_files} files synced by dflashops ({FILES} x {FILE_BYTES} B + trainer package + agent); "
            f"rsync: the {FILES}-file tree"
        )
        print(
            "| case | dflashops up/down (B) | files sent | rsync on the wire up/down (B, incl. ssh) | "
            "rsync self-reported sent (B) |"
        )
        print("|---|---|---|---|---|")
        for case, (up, down, sent_files), (r_up, r_down, r_sent) in rows:
            print(f"| {case} | {up} / {down} | {sent_files} | {r_up} / {r_down} | {r_sent} |")


if __name__ == "__main__":
    main()
