"""Warm-up of the real drafter replicas before any worker thread exists (docs/method.md#compiling).

The shapes a run meets are known in advance: every micro-batch's (rows R, padded context length S) follows
from the epochs' batches (sample lengths only, no token pages touched), and N anchors per row is a function of R.
`warm_up_drafters` runs one real forward+backward per (drafter replica x distinct shape) — both layer-type
masks (full, sliding) are built in every forward, so mask variants are covered — then throws the gradients
away and restores the RNG, so the run trains exactly as if no warm-up had happened. The count of variants
is what a compile-cache-cold start costs: keep shape buckets coarse (trainer.data.batches.padded_length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trainer.data.batches import BatchStream, padded_length
from trainer.pipeline.assignment import GlobalOrder
from trainer.pipeline.compile_guard import WarmupReport, warm_up
from trainer.state.checkpoint import restore_rng, rng_state


def shapes_to_warm(
    stream: BatchStream, order: GlobalOrder, g_start: int, g_end: int, owns: Callable[[int], bool] | None = None
) -> dict[tuple[int, int], int]:
    """(rows, padded context length) of every micro-batch in [g_start, g_end) (that this node `owns`, in a
    distributed run) -> the first g with that shape."""
    cfg = stream.cfg
    lengths = np.minimum(stream.dataset.lengths, cfg.max_seq_len)
    first: dict[tuple[int, int], int] = {}
    for g in range(g_start, g_end):
        if owns is not None and not owns(g):
            continue
        epoch, index = order.position(g)
        ids = stream.epoch_batches(epoch)[index]
        shape = (len(ids), padded_length(int(lengths[ids].max()), cfg.max_seq_len))
        first.setdefault(shape, g)
    return first


def warm_up_drafters(
    sides: Sequence[Any],
    target_sides: Sequence[Any],
    make_batch: Callable[[int], Any],
    stream: BatchStream,
    order: GlobalOrder,
    g_start: int,
    g_end: int,
    owns: Callable[[int], bool] | None = None,
    done: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset(),
) -> tuple[WarmupReport, set[tuple[int, int]]]:
    """Forward+backward every replica on one real batch of every shape not in `done` (warmed already); leaves
    weights, grads, RNG untouched. Returns the report and every shape warmed now or before. Needs no particular
    weights: a restart warms its replicas before the checkpoint is read (trainer.training.loop). The features come from
    the first target; a compiled target (--target-compile) runs every shape too, since each compiles its own
    private copy and its thread may meet any shape."""
    shapes = {s: g for s, g in shapes_to_warm(stream, order, g_start, g_end, owns).items() if s not in done}
    variants = [(number, shape) for number in range(len(sides)) for shape in sorted(shapes)]
    features_by_shape: dict[tuple[int, int], Any] = {}
    saved_rng = rng_state()

    def run_one(variant: tuple[int, tuple[int, int]]) -> None:
        number, shape = variant
        if shape not in features_by_shape:
            batch = make_batch(shapes[shape])
            with torch.no_grad():
                features_by_shape[shape] = target_sides[0].features(batch)
                for other in target_sides[1:]:
                    if other.compiled:
                        other.features(batch)
        features = features_by_shape[shape]
        side = sides[number]
        weight_sum = max(float(features.batch.weight_sum), 1.0)
        side.forward_backward(features, weight_sum, float(max(features.batch.num_blocks, 1)))
        side.optimizer.zero_grad(set_to_none=True)
        if side.device.type == "cuda":
            torch.cuda.synchronize(side.device)

    class Label(tuple):
        def __str__(self) -> str:
            return f"drafter{self[0]} on {sides[self[0]].device} R={self[1][0]} S={self[1][1]}"

    report = warm_up([Label(v) for v in variants], run_one)
    restore_rng(saved_rng)
    return report, {*done, *shapes}
