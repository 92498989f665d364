"""--target-compile: the frozen target's decoder layers through one compiled layer call per target
(TargetModel.compile_layers). On the CPU with dynamo's eager backend the compiled forward is bit-identical to HF's
eager one, so these tests compare bits; what they check is the wiring: one graph for all layers, the taps' hooks
and the early exit intact, and in the threaded pipeline every target warmed before its thread starts (the
CompileGuard turns any compile in a worker thread into a failed run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny import tiny_target_config, tiny_train_config
from trainer.model.target import TargetModel
from trainer.pipeline.compile_guard import compile_counts
from trainer.pipeline_run import PipelineOptions, run_pipeline
from trainer.train import EXIT_OK

pytestmark = pytest.mark.timeout(240)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (2, 24), generator=generator)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0  # right padding, as the trainer's batches
    return ids, mask


def test_compiled_layers_give_the_same_taps_with_one_graph_for_all_layers() -> None:
    torch.set_num_threads(1)
    # taps [0, 2] of 4 layers: without the final hidden the forward stops after layer 2 (a hook raises)
    target = TargetModel.from_config(tiny_target_config(num_hidden_layers=4), [0, 2], seed=0)
    ids, mask = _batch()
    eager = target.features(ids, mask, return_final_hidden=True)
    eager_taps_only = target.features(ids, mask).taps
    target.compile_layers(backend="eager")
    before = compile_counts()
    compiled = target.features(ids, mask, return_final_hidden=True)
    after_first = compile_counts()
    compiled_taps_only = target.features(ids, mask).taps  # the early exit through a compiled layer's hook
    again = compile_counts()
    assert torch.equal(compiled.taps, eager.taps) and torch.equal(compiled_taps_only, eager_taps_only)
    assert compiled.final_hidden is not None and eager.final_hidden is not None
    assert torch.equal(compiled.final_hidden, eager.final_hidden)
    # four layers, one frame: dynamo takes the layer as an input, so the layers share the compiled code
    assert after_first["frames"] - before["frames"] == 1
    assert again == after_first  # the same shape again compiles nothing


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_warms_every_compiled_target_and_trains_as_the_eager_one(tmp_path: Path) -> None:
    """Two target threads, two drafter threads, several batch shapes: each target's private compiled copy is
    warmed for every shape before the threads start (otherwise the second target compiles in its thread and the
    CompileGuard fails the run), and the run's losses equal the eager target's."""
    torch.set_num_threads(1)
    compiled_frames: dict[bool, int] = {}
    losses: dict[bool, list[float]] = {}
    for on in (True, False):
        out = tmp_path / f"compile-{on}"
        cfg = tiny_train_config(
            out,
            *("--target-gpus", "cpu,cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", "3"),
            *("--max-seq-len", "384", "--token-budget", "768", "--target-compile", "on" if on else "off"),
        )
        reports = []
        options = PipelineOptions(compile_backend="eager", on_warmup=reports.append)
        assert run_pipeline(cfg, options) == EXIT_OK
        assert len({variant[1] for report in reports for variant, _ in report.seconds_per_variant}) >= 2  # shapes
        compiled_frames[on] = sum(report.compiles["frames"] for report in reports)
        losses[on] = _losses(out)
    assert compiled_frames[True] > compiled_frames[False]  # the targets' layer calls were compiled in the warm-up
    assert len(losses[True]) == 3 and losses[True] == losses[False]
