"""`dflashops status RUN` of a run on two targets when one node's container is stopped (issue 27, item 9):
every node keeps its line, the node that cannot be reached says `unreachable` with the reason, `--json` keeps
one entry per node (that one with state "unreachable" and an "error"), and the exit status is the transport
error's (5), as for a one-target run whose target cannot be reached. Two pct stand-in containers of this test's
own behind the real sshd, the workload script on each (no torch: a profile only needs a node placeholder)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from remote_harness import Harness

NODES = ("206", "207")
PROFILE = """\
  pairwork:
    argv: ["{python}", "{release}/workload.py", "--output-dir", "{run_dir}", "--steps", "100000",
           "--interval", "0.05", "--state-file", "{run_dir}/node{node_rank}.starts"]
    files: [workload.py]
"""


@pytest.fixture
def pair(tmp_path: Path, harness: Harness) -> Iterator[Path]:
    """An inventory with targets n206 (node 0) and n207 (node 1), both containers running; at the end the
    test's runs are stopped and both containers are running again."""
    workspace = f"/workspace/{tmp_path.name}"
    for ct in NODES:
        harness.create_container(ct, f"mn{ct}")
    nodes = "".join(
        f"n{ct}: {{kind: pct, host: pve, ctid: {ct}, workspace: {workspace}, address: 127.0.0.1}}\n" for ct in NODES
    )
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, workspace=workspace, extra_targets=nodes)
    inventory.write_text(inventory.read_text() + PROFILE)
    try:
        yield inventory
    finally:
        for ct in NODES:
            harness.pct("start", ct, check=False)  # "already running" for the one that was never stopped
        for run in ("mn-u1", "mn-u2"):
            cli("--inventory", str(inventory), "stop", run, "--grace", "5")


def status(inventory: Path, *extra: str, run: str = "mn-u1") -> tuple[int, str, str]:
    return cli("--inventory", str(inventory), "status", run, *extra)


@pytest.mark.parametrize("stopped", [1, 0], ids=["node1-stopped", "node0-stopped"])
def test_status_of_a_run_with_a_stopped_node_shows_every_node(pair: Path, harness: Harness, stopped: int) -> None:
    code, _, err = cli(
        "--inventory", str(pair), "deploy", "n206,n207", "--profile", "pairwork", "--name", "mn-u1",
        "--launcher", "nohup", "--wait", r"^\[node 1\] step 1 ", "--timeout", "60",
    )  # fmt: skip
    assert code == 0, err
    code, out, err = status(pair)  # both reached: the lineage records the job as running
    assert code == 0 and len(re.findall(r"^mn-u1@node\d\s+n\d+\s+running\s", out, re.M)) == 2, out + err
    harness.pct("stop", NODES[stopped])
    ct = NODES[stopped]

    code, out, err = status(pair)
    assert code == 5 and "Traceback" not in err, err
    lines = out.splitlines()  # the header, its rule, the running node first, then the one that is unreachable
    running = 1 - stopped
    assert re.match(rf"mn-u1@node{running}\s+n{NODES[running]}\s+running\s", lines[2]), out
    assert re.match(rf"mn-u1@node{stopped}\s+n{ct}\s+unreachable\s", lines[3]), out
    assert f"mn-u1@node{stopped} error: container {ct} on pve is stopped" in out, out
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert errors[0].startswith(
        f"error: node {stopped} (n{ct}) of run 'mn-u1' is unreachable: container {ct} on pve is stopped"
    )
    assert "hint: " in err and f"pct start {ct}" in err, err

    code, out, err = status(pair, "--json")
    assert code == 5, err
    runs = json.loads(out)["runs"]
    assert [(r["node"], r["target"], r["state"]) for r in runs] == sorted(
        [(running, f"n{NODES[running]}", "running"), (stopped, f"n{ct}", "unreachable")]
    )
    assert runs[stopped]["error"].startswith(f"container {ct} on pve is stopped") and "error" not in runs[running]

    code, out, _ = cli("--inventory", str(pair), "runs", "show", "mn-u1", "--json")
    assert code == 0 and json.loads(out)["state"] == "running"  # not recorded as crashed: a node's state is unknown


def test_an_ended_run_with_a_stopped_node_is_not_recorded_as_crashed(pair: Path, harness: Harness) -> None:
    code, _, err = cli(
        "--inventory", str(pair), "deploy", "--detach", "n206,n207", "--profile", "pairwork", "--name", "mn-u2",
        "--launcher", "nohup", "--", "--steps", "3", "--interval", "0",
    )  # fmt: skip
    assert code == 0, err
    code, _, err = cli("--inventory", str(pair), "logs", "mn-u2", "-f", "--timeout", "60")  # until both end
    assert code == 0, err
    code, out, err = status(pair, run="mn-u2")
    finished = re.compile(r"^mn-u2@node\d\s+\S+\s+finished\b", re.M)  # a node's row of the status table
    assert code == 0 and len(finished.findall(out)) == 2, out + err
    harness.pct("stop", "207")
    code, out, err = status(pair, run="mn-u2")
    assert code == 5 and len(finished.findall(out)) == 1, out + err
    assert re.search(r"^mn-u2@node1\s+\S+\s+unreachable\b", out, re.M), out + err
    assert "container 207 on pve is stopped" in out, out + err
    code, out, _ = cli("--inventory", str(pair), "runs", "show", "mn-u2", "--json")
    assert code == 0 and json.loads(out)["state"] == "finished"  # the job's state is not known: nothing recorded
