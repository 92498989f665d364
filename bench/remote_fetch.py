"""Bench: `dflashops fetch` of a 1 GB checkpoint file vs `scp` of the same file, and a cut at 50%.

Throughput: the file lies in container 200's workspace (a fake finished run `bench1` whose checkpoint is one
1 GB `model.bin` of random bytes). `scp -O` copies it from the container's disk path on the host (the seed's
hand-typed way); `dflashops fetch bench1` brings it through `pct exec` + the agent, verifies the sha256 and
renames it into place. Both straight to sshd (no proxy), fresh processes, alternating, ROUNDS times each.
Cut: the same fetch through the loopback proxy, every connection cut once half the file came down; reported:
the bytes that came down after the cut (the first half must not come again) and the wall time.

Usage (root; not part of `make test`): .venv/bin/python bench/remote_fetch.py [--mb 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from remote_common import cli, harness_session, median, write_inventory


def make_run(harness, mb: int) -> tuple[Path, str]:
    """A finished run `bench1` with one `mb` MiB checkpoint file; (host path of the file, its sha256)."""
    run = harness.pct_state / "200" / "workspace" / "bench" / "runs" / "bench1"
    step = run / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": "bench1", "target": "ct200"}))
    (run / "exit_code").write_text("0\n")
    digest = hashlib.sha256()
    with (step / "model.bin").open("wb") as handle:
        for _ in range(mb):
            block = os.urandom(1 << 20)
            digest.update(block)
            handle.write(block)
    for folder in (harness.pct_state / "200" / "workspace", run.parent.parent, run.parent, run, step.parent, step):
        folder.chmod(0o755)
    return step / "model.bin", digest.hexdigest()


def scp(harness, source: Path, dest: Path) -> float:
    started = time.monotonic()
    subprocess.run(
        [
            "scp",
            "-O",
            "-q",
            "-i",
            str(harness.client_key),
            "-o",
            f"UserKnownHostsFile={harness.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-P",
            str(harness.port),
            f"{harness.user}@127.0.0.1:{source}",
            str(dest),
        ],
        check=True,
    )
    return time.monotonic() - started


def fetch(inventory: Path, dest: Path) -> tuple[float, dict]:
    started = time.monotonic()
    out = cli(inventory, "fetch", "bench1", "--to", str(dest), "--json").stdout
    return time.monotonic() - started, json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with harness_session("dfo-bench-fetch-") as (harness, proxy, folder):
        source, want = make_run(harness, args.mb)
        size = source.stat().st_size
        direct = write_inventory(folder / "direct", harness, harness.port, [], ["true"])
        proxied = write_inventory(folder / "proxied", harness, proxy.port, [], ["true"])
        scp_s, fetch_s, inner = [], [], []
        for round_ in range(args.rounds):
            for arm in ("scp", "fetch") if round_ % 2 == 0 else ("fetch", "scp"):
                dest = folder / f"out-{arm}"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                if arm == "scp":
                    scp_s.append(scp(harness, source, dest / "model.bin"))
                else:
                    seconds, outcome = fetch(direct, dest)
                    fetch_s.append(seconds)
                    inner.append(outcome["rate_mib_s"])
                    got = dest / "checkpoints" / "step_000001" / "model.bin"
                    assert hashlib.sha256(got.read_bytes()).hexdigest() == want
                shutil.rmtree(dest, ignore_errors=True)
        load = os.getloadavg()[0]
        print(
            f"| {args.mb} MiB | {load:.1f} | {args.rounds} | {median(scp_s):.2f} ({size / median(scp_s) / 1e6:.0f} MB/s)"
            f" | {median(fetch_s):.2f} ({size / median(fetch_s) / 1e6:.0f} MB/s; in-process {median(inner):.0f} MiB/s)"
            f" | **{median(scp_s) / median(fetch_s):.2f}x** |"
        )
        print(f"  scp runs: {[round(s, 2) for s in scp_s]}  fetch runs: {[round(s, 2) for s in fetch_s]}")

        dest = folder / "out-cut"
        proxy.reset_counters()
        proxy.cut_after_down(size // 2)
        started = time.monotonic()
        result = cli(proxied, "fetch", "bench1", "--to", str(dest), "--json")
        seconds = time.monotonic() - started
        model = next(f for f in json.loads(result.stdout)["files"] if f["path"].endswith("model.bin"))
        after = proxy.bytes_down - (proxy.bytes_down_at_cut or 0)
        got = dest / "checkpoints" / "step_000001" / "model.bin"
        assert hashlib.sha256(got.read_bytes()).hexdigest() == want
        print(
            f"cut at 50%: cuts={proxy.connections_cut} resumes={model['resumes']} how={model['how']} "
            f"down before cut={proxy.bytes_down_at_cut:,} after cut={after:,} ({after / size:.3f} of the file) "
            f"wall={seconds:.2f}s"
        )


if __name__ == "__main__":
    main()
