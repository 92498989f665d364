"""A run on two targets (issue 16, section 3): two pct stand-in containers behind the real sshd, real torchrun
on each (gloo over 127.0.0.1: the stand-in containers share the host's network), the tiny trainer with two
drafter threads per node, deployed, followed, stopped and resumed through the real CLI as one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from remote_harness import Harness, free_port

DIST_PROFILE = """\
  dist:
    argv: ["{python}", -m, torch.distributed.run, --nnodes, "{nnodes}", --node-rank, "{node_rank}",
           --master-addr, "{master_addr}", --master-port, "{master_port}", --nproc-per-node, "1",
           -m, trainer, train, --preset, tiny, --wandb, "off", --synthetic-samples, "48", --epochs, "1000",
           --max-steps, "100000", --log-interval, "1", --save-interval, "1000", --target-gpus, cpu,
           --drafter-gpus, "cpu,cpu", --dist-timeout, "60", --nodes, "{nnodes}", --output-dir, "{run_dir}"]
    resume_args: [--resume, "{checkpoint}"]
    env: {GLOO_SOCKET_IFNAME: lo, OMP_NUM_THREADS: "1", TRAINER_TEST_MIN_STEP_S: "0.1"}
  single:
    argv: ["{python}", "{release}/workload.py", --output-dir, "{run_dir}"]
    files: [workload.py]
"""


@pytest.fixture
def pair(tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch) -> Path:
    workspace = f"/workspace/{tmp_path.name}"
    python = sys.executable  # the test's venv: torch is there, and the stand-in's containers see this path
    nodes = "".join(
        f"n{ct}: {{kind: pct, host: pve, ctid: {ct}, workspace: {workspace}, python: {python}, address: 127.0.0.1}}\n"
        for ct in (200, 202)
    )
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, workspace=workspace, extra_targets=nodes)
    text = (
        inventory.read_text()
        + DIST_PROFILE
        + f"groups:\n  pair: {{targets: [n200, n202], master_port: {free_port()}}}\n"
    )
    inventory.write_text(text)
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(inventory))
    return inventory


def node_file(harness: Harness, ct: str, inventory: Path, run: str, name: str) -> Path:
    return harness.container_path(ct, f"/workspace/{inventory.parent.name}/runs/{run}/{name}")


def test_a_two_node_run_is_one_run_through_every_verb(pair: Path, harness: Harness) -> None:
    try:
        code, out, err = cli(
            "deploy",
            "pair",
            "--profile",
            "dist",
            "--name",
            "mn-a1",
            "--launcher",
            "nohup",
            "--wait",
            r"^\[node 0\] step 3/",
            "--timeout",
            "180",
        )
        assert code == 0, err
        assert "on node 0 of 2 on n200" in err and "on node 1 of 2 on n202" in err
        code, out, err = cli("status", "mn-a1", "--json")
        runs = json.loads(out)["runs"]
        assert [(r["node"], r["target"], r["state"]) for r in runs] == [(0, "n200", "running"), (1, "n202", "running")]
        code, out, _ = cli("logs", "mn-a1")
        assert code == 0 and "[node 0] step 1/" in out and "[node 1] step 1/" in out
        code, out, _ = cli("logs", "mn-a1", "--node", "1")
        assert code == 0 and "step 1/" in out and "[node" not in out
        code, out, err = cli("stop", "mn-a1", "--grace", "60")
        assert code == 0 and "exit_code=143" in out, err
        statuses = [
            json.loads(node_file(harness, ct, pair, "mn-a1", "status.json").read_text()) for ct in ("200", "202")
        ]
        assert [s["phase"] for s in statuses] == ["stopped", "stopped"]
        step = statuses[0]["step"]
        assert statuses[1]["step"] == step  # every node finished the same step
        assert node_file(harness, "200", pair, "mn-a1", f"checkpoints/step_{step:06d}").is_dir()
        assert not node_file(harness, "202", pair, "mn-a1", "checkpoints").exists()  # written once, by node 0

        code, out, err = cli(
            "restart",
            "mn-a1",
            "--resume",
            "--launcher",
            "nohup",
            "--wait",
            r"^\[node 0\] step \d+/",
            "--timeout",
            "180",
        )
        assert code == 0, err
        child = out.splitlines()[0]
        log = node_file(harness, "200", pair, child, "train.log").read_text()
        assert f"at step {step}" in log and "resumed from" in log
        code, out, _ = cli("runs", "show", child, "--json")
        record = json.loads(out)
        assert record["parent"] == "mn-a1" and [n["target"] for n in record["extra"]["nodes"]] == ["n200", "n202"]
        code, out, err = cli("stop", child, "--grace", "60")
        assert code == 0, err
        code, out, _ = cli("runs", "list")
        assert "n200,n202" in out
    finally:
        for name in ("mn-a1", "mn-a2"):
            cli("stop", name, "--grace", "10")


def test_bad_multi_node_requests_launch_nothing(pair: Path, harness: Harness) -> None:
    code, _, err = cli("deploy", "--detach", "pair", "--profile", "single", "--name", "mn-b1")
    assert code == 2 and "does not use {node_rank}" in err and "hint: use a torchrun profile" in err
    code, _, err = cli("deploy", "--detach", "n200,n999", "--profile", "dist", "--name", "mn-b2")
    assert code == 3 and "unknown target 'n999'" in err
    pair.write_text(pair.read_text().replace("address: 127.0.0.1}", "}"))
    code, _, err = cli("deploy", "--detach", "n200,n202", "--profile", "dist", "--name", "mn-b3")
    assert code == 2 and "no address for node 0 (n200)" in err and "hint: add `address:`" in err
    for ct in ("200", "202"):
        for name in ("mn-b1", "mn-b2", "mn-b3"):
            assert not node_file(harness, ct, pair, name, "run.json").exists()
