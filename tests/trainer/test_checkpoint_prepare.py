"""CheckpointWriter.prepare: host buffers made ahead of the first snapshot are the ones it fills (matched by
position in the checkpoint's nest), and a snapshot that comes while they are being made waits for them.
Pinning itself needs CUDA (measured on the H200: bench/results/pipeline.md 2026-11-29); on the CPU `prepare` has nothing to pin."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from trainer.state.checkpoint import CheckpointWriter, _tensors


def parts() -> dict:
    model = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(5)}
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}}, "param_groups": [{"lr": 0.1}]}
    return dict(model=model, optimizer=optimizer, scheduler={"last_epoch": 3}, epoch=0, index=7, extra={"k": 1})


def test_prepare_does_nothing_without_cuda_tensors(tmp_path: Path) -> None:
    with CheckpointWriter(tmp_path, keep=2) as writer:
        writer.prepare({"model": parts()["model"]})
        assert writer._spare == [] and not writer._preparing


def test_buffers_made_ahead_are_the_ones_the_first_snapshot_fills(tmp_path: Path) -> None:
    made = parts()
    layout = {"model": made["model"], "optimizer": made["optimizer"]}
    shapes = [(tuple(t.shape), t.dtype, False) for t in _tensors(layout)]  # what prepare hands its thread
    with CheckpointWriter(tmp_path, keep=2) as writer:
        writer._preparing = True
        writer._pin(shapes)
        made_ahead = [t.data_ptr() for t in writer._spare]
        snapshot = writer.snapshot(5, **made)
        assert [t.data_ptr() for t in snapshot.buffers] == made_ahead
        assert all(torch.equal(a, b) for a, b in zip(snapshot.buffers, _tensors(layout)))
        writer.submit(snapshot)
        assert writer.wait()[0].name == "step_000005"


def test_a_snapshot_waits_for_the_buffers_being_made(tmp_path: Path) -> None:
    made = parts()
    shapes = [
        (tuple(t.shape), t.dtype, False) for t in _tensors({"model": made["model"], "optimizer": made["optimizer"]})
    ]
    with CheckpointWriter(tmp_path, keep=2) as writer:
        writer._preparing = True
        thread = threading.Thread(target=lambda: (time.sleep(0.3), writer._pin(shapes)))
        thread.start()
        started = time.monotonic()
        snapshot = writer.snapshot(5, **made)
        thread.join()
        assert time.monotonic() - started >= 0.25 and len(snapshot.buffers) == 4
