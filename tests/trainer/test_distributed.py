"""The distributed engine with real torchrun processes: two nodes on 127.0.0.1, gloo, two drafter threads each.

Every node is its own torchrun (as two containers would run it, tests/trainer/dist_nodes.py); the references
are one-node runs of the threaded pipeline with the same four drafters on the same data, in this process.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.dist_nodes import REPO, TINY, start_nodes, stop_all, wait_all, wait_for_metrics
from trainer.__main__ import main as trainer_main
from trainer.core.config import parse_train_args
from trainer.pipeline.assignment import Assignment
from trainer.pipeline_run import run_pipeline

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def nodes_started():
    """Collects started nodes and kills whatever of them is left when the test ends."""
    started: list = []
    yield started
    stop_all(started)


def _one_node_reference(out: Path, *args: str) -> list[dict]:
    """The same job on one node with all four drafters (in this process)."""
    torch.set_num_threads(1)
    flags = [a for a in TINY if a not in ("--dist-timeout", "20")]
    flags[flags.index("cpu,cpu")] = "cpu,cpu,cpu,cpu"
    assert run_pipeline(parse_train_args([*flags, "--output-dir", str(out), *args])) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _newest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def test_two_nodes_under_grad_sync_train_like_one_node_with_all_their_drafters(tmp_path: Path, nodes_started) -> None:
    nodes = start_nodes(tmp_path, ["--max-steps", "6"])
    nodes_started += nodes
    assert wait_all(nodes, 150) == [0, 0], nodes[0].log()[-3000:] + nodes[1].log()[-3000:]
    zero, one = nodes
    metrics = zero.metrics()
    reference = _one_node_reference(tmp_path / "reference", "--max-steps", "6")
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference], rel=1e-5, abs=1e-6)
    assert [m["tau_sim"] for m in metrics] == pytest.approx([m["tau_sim"] for m in reference], rel=1e-5)
    final = metrics[-1]
    assert len(final["replica_checksums"]) == 4 and len(set(final["replica_checksums"])) == 1  # across nodes
    assert f"replica checksums at step 6: {' '.join(final['replica_checksums'])} (identical)" in one.log()
    weights = load_file(str(_newest_checkpoint(zero.run_dir) / "model.safetensors"))
    for name, tensor in load_file(str(_newest_checkpoint(tmp_path / "reference") / "model.safetensors")).items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6)
    # What crossed the nodes per step: the summed gradient of every trainable parameter in fp32, plus the
    # normaliser (2 float64) and the stop flag (one int64).
    trainable = sum(t.numel() for t in weights.values())
    kinds = final["dist_bytes_per_step_by_kind"]
    assert (kinds["grad"], kinds["normaliser"], kinds["stop"]) == (4 * trainable, 16, 8)
    assert final["nodes"] == 2 and final["dist_bytes_per_step"] >= 4 * trainable + 24
    # Node 0 writes the job's metrics and checkpoints; node 1 its status and config only.
    assert (zero.status()["phase"], one.status()["phase"], one.status()["node"], one.status()["step"]) == (
        "done",
        "done",
        1,
        6,
    )
    assert sorted(p.name for p in one.run_dir.iterdir()) == ["status.json", "train_config.json"]
    state = json.loads((_newest_checkpoint(zero.run_dir) / "state.json").read_text())
    assert state["pipeline"]["nodes"] == 2 and state["pipeline"]["next_micro_batch"] == 24


def test_average_sync_averages_every_replica_of_both_nodes_and_resumes_each_replica(
    tmp_path: Path, nodes_started
) -> None:
    args = ["--max-steps", "6", "--sync", "average", "--sync-interval", "2", "--save-interval", "4"]
    nodes = start_nodes(tmp_path, args)
    nodes_started += nodes
    assert wait_all(nodes, 150) == [0, 0], nodes[0].log()[-3000:] + nodes[1].log()[-3000:]
    metrics = nodes[0].metrics()
    reference = _one_node_reference(tmp_path / "reference", *args)
    # The replicas of both nodes are averaged together: the same losses as four averaged drafters on one node.
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference], rel=1e-5, abs=1e-6)
    # Weights cross the nodes after steps 2 and 4 (and for the checkpoint after step 4, counted in step 5).
    assert ["average" in m["dist_bytes_per_step_by_kind"] for m in metrics][:4] == [False, True, False, True]
    assert "grad" not in metrics[-1]["dist_bytes_per_step_by_kind"]
    assert len(set(metrics[-1]["replica_checksums"])) == 1  # step 6 averaged them
    checkpoint = nodes[0].run_dir / "checkpoints" / "step_000004"
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    assert len(optimizer["pipeline_replicas"]) == 3  # every other replica's AdamW state, node 1's included

    # Resumed from step 4, each replica gets its own AdamW state back: steps 5 and 6 come out bit for bit.
    resumed = start_nodes(tmp_path, [*args, "--resume", str(checkpoint)], name="resumed")
    nodes_started += resumed
    assert wait_all(resumed, 150) == [0, 0], resumed[0].log()[-3000:] + resumed[1].log()[-3000:]
    assert [(m["step"], m["loss"]) for m in resumed[0].metrics()] == [(m["step"], m["loss"]) for m in metrics[4:]]


def test_sigterm_to_one_node_stops_every_node_after_the_same_step_and_both_resume(
    tmp_path: Path, nodes_started, capsys
) -> None:
    nodes = start_nodes(tmp_path, ["--max-steps", "5000"], name="long")
    nodes_started += nodes
    zero, one = nodes
    wait_for_metrics(zero, 3)
    one.proc.send_signal(signal.SIGTERM)  # to node 1's torchrun, which forwards it to its worker
    wait_all(nodes, 90)
    stopped = [zero.status(), one.status()]
    step = stopped[0]["step"]
    assert [(s["phase"], s["exit_code"], s["step"]) for s in stopped] == [("stopped", 143, step)] * 2, (
        zero.log()[-2000:] + one.log()[-2000:]
    )
    for node in nodes:
        assert f"stop requested on node 1 (SIGTERM): every node stops after step {step}" in node.log()
    assert (zero.run_dir / "checkpoints" / f"step_{step:06d}" / "state.json").is_file()
    assert not (one.run_dir / "checkpoints").exists()  # checkpoints are written once, by node 0

    # The checkpoint of two nodes does not resume on one.
    assert (
        trainer_main(
            [
                "train",
                *[a for a in TINY if a not in ("--dist-timeout", "20")],
                "--output-dir",
                str(zero.run_dir),
                "--max-steps",
                "5000",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: --resume: checkpoint ") and "was written by a run on 2 node(s)" in err
    assert "hint: resume it on 2 node(s)" in err

    # The two run directories swapped between the nodes: the node that would read checkpoints has none.
    swapped = start_nodes(
        tmp_path,
        ["--max-steps", "5000"],
        name="long",
        per_node={0: ["--output-dir", str(one.run_dir)], 1: ["--output-dir", str(zero.run_dir)]},
    )
    nodes_started += swapped
    assert all(code != 0 for code in wait_all(swapped, 120))
    assert "holds the run's checkpoints" in swapped[0].log() and "the nodes' ranks changed" in swapped[1].log()
    assert zero.status()["phase"] == "stopped"  # nothing written

    # Both nodes again, the same command with a nearer horizon: node 1 has no checkpoint of its own (no shared
    # storage) and gets node 0's.
    again = start_nodes(tmp_path, ["--max-steps", str(step + 2)], name="long")
    nodes_started += again
    assert wait_all(again, 150) == [0, 0], again[0].log()[-3000:] + again[1].log()[-3000:]
    for node in again:
        assert f"/checkpoints/step_{step:06d} at step {step} (epoch " in node.log()
        assert node.status()["phase"] == "done"
    assert [m["step"] for m in again[0].metrics()][-3:] == [step, step + 1, step + 2]


def test_a_node_killed_with_sigkill_ends_the_other_in_bounded_time_naming_it(tmp_path: Path, nodes_started) -> None:
    nodes = start_nodes(tmp_path, ["--max-steps", "5000"])
    nodes_started += nodes
    zero, one = nodes
    wait_for_metrics(zero, 2)
    victim = one.worker_pid()
    assert victim is not None
    import os

    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    zero.proc.wait(timeout=60)
    elapsed = time.monotonic() - started
    assert zero.proc.returncode != 0 and elapsed < 20 + 10  # --dist-timeout 20 bounds it; gloo sees a dead peer at once
    status = zero.status()
    assert status["phase"] == "failed" and status["exit_code"] == 1
    assert status["error"].startswith("lost node 1 (") and "no heartbeat" in status["error"]
    log = zero.log()
    assert "error: lost node 1 (" in log and "hint: every node of the run stops" in log


@pytest.mark.parametrize("differs", ["code", "config", "input"])
def test_nodes_with_other_code_config_or_bad_input_are_refused_before_training(
    tmp_path: Path, nodes_started, differs: str
) -> None:
    code_dirs, per_node = {}, {}
    if differs == "input":  # node 1's own pre-flight refuses (its data directory is missing)
        per_node[1] = ["--data-dir", str(tmp_path / "missing")]
    elif differs == "code":  # node 1 runs a checkout whose trainer differs by one comment
        other = tmp_path / "other-checkout"
        shutil.copytree(REPO / "trainer", other / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
        with open(other / "trainer" / "training" / "loop.py", "a") as handle:
            handle.write("# a local edit on node 1\n")
        code_dirs[1] = other
    else:
        per_node[1] = ["--lr", "0.001"]
    nodes = start_nodes(tmp_path, ["--max-steps", "4"], code_dirs=code_dirs, per_node=per_node)
    nodes_started += nodes
    codes = wait_all(nodes, 120)
    assert all(code != 0 for code in codes)
    expected = {
        "code": "runs other trainer code than node 0",
        "config": "--lr is 0.001 there, 0.003 on node 0",
        "input": "refused to start: --data-dir: ",
    }[differs]
    for node in nodes:
        log = node.log()
        if differs == "input" and node.rank == 1:
            assert "error: --data-dir: " in log, log[-3000:]  # its own error, as a single node would say it
        else:
            assert "error: node 1 (" in log and expected in log, log[-3000:]
        assert "\nhint: " in log
        assert not node.run_dir.exists()  # refused before anything was written


@pytest.mark.parametrize(
    "env, flags, message",
    [
        ({}, ["--nodes", "2"], "--nodes 2: a run on several nodes is started by torchrun, one process per node"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}, ["--nodes", "2"], "torchrun --nproc-per-node 2"),
        ({"WORLD_SIZE": "3", "RANK": "0", "LOCAL_WORLD_SIZE": "1"}, ["--nodes", "2"], "torchrun started 3 node(s)"),
        ({}, ["--nodes", "0"], "--nodes: must be >= 1"),
        ({}, ["--dist-timeout", "0"], "--dist-timeout: must be > 0"),
    ],
)
def test_bad_distributed_input_is_one_error_and_a_hint(
    tmp_path: Path, monkeypatch, capsys, env: dict, flags: list, message: str
) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if env:  # what torchrun would have set for this process
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    out = tmp_path / "never"
    assert trainer_main(["train", "--preset", "tiny", "--output-dir", str(out), *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and message in err[0] and err[1].startswith("hint: ") and len(err) == 2
    assert not out.exists()


def test_each_node_reads_a_disjoint_shard_of_the_global_order_of_a_one_node_run() -> None:
    """Node r of N (D drafters each) trains on exactly the micro-batches that drafters r*D.. of a one-node run
    with N*D drafters would: disjoint shards that cover every step, in the same order."""
    one_node = Assignment(num_targets=1, num_drafters=4, grad_accum=2)
    shards = [Assignment(num_targets=2, num_drafters=2, grad_accum=2, num_nodes=2, node_rank=r) for r in range(2)]
    seen: dict[int, int] = {}
    for rank, node in enumerate(shards):
        for target in range(2):
            for g in node.indices_of_target(target, 8, 40):
                assert g not in seen and node.target_of(g) == target
                seen[g] = rank
                assert one_node.drafter_of(g) == node.drafter_of(g) == node.first_drafter + node.local_drafter_of(g)
    assert sorted(seen) == list(range(8, 40))
    assert [g for g in range(8, 40) if seen[g] == 1][:4] == [12, 13, 14, 15]  # node 1: drafters 2 and 3, step 1
    assert node.micro_index(3, 2, 1) == one_node.micro_index(3, 2, 1) == 29
