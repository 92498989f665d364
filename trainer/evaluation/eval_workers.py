"""Evaluation in worker processes: the target's greedy references and `eval.evaluate` of slices of the prompts, each
slice in a process of its own, the slices' reports merged (`eval.merge_reports`: counts summed, the same report as
one process's).

Why processes: an evaluation runs one sequence at a time. On the CPU a 135M target's forward of a few tokens reads
all of its weights (memory-bound, ~70 ms on this 2-core machine), and two single-thread processes run 1.9x one
(quality.md 2026-12-07 "`make demo-real` in twenty minutes"); two intra-op threads instead spin against other
processes under load (regenerate.choose_threads). On a GPU it is latency-bound and the device mostly idle; N
processes keep N sequences in flight (quality.md 2026-12-06 "A real target on an H100").

`worker_pool(0)` runs every job in this process, at once, with the same functions: a 1-core machine or a test pays
no interpreter start, and both paths compute the same thing. A worker loads the target once (`target`) and keeps it
for its later jobs.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.core.parent_watch import end_with_parent
from trainer.evaluation import eval as eval_mod
from trainer.model.drafter import DFlashDrafter, DrafterConfig


class InProcess(Executor):
    """An Executor that runs each job when it is submitted, in this process."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered to whoever asks for the result, as a pool does
            future.set_exception(exc)
        return future


def worker_pool(processes: int, threads: int = 1) -> Executor:
    """`processes` processes of their own (spawned: CUDA cannot be used in a forked child), `threads` intra-op
    threads each; or, for 0, this process."""
    if processes <= 0:
        return InProcess()
    context = multiprocessing.get_context("spawn")
    start = (threads, os.getpid())
    return ProcessPoolExecutor(processes, mp_context=context, initializer=_start_worker, initargs=start)


def _start_worker(threads: int, parent: int) -> None:
    end_with_parent(parent)  # a parent killed alone must not leave a worker holding the target
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # the references are the fp32 target's: no TF32 in a verify


def slices(items: list, parts: int) -> list[list]:
    """`items` cut into at most `parts` consecutive slices of nearly equal length."""
    size = max(1, -(-len(items) // max(1, parts)))
    return [items[i : i + size] for i in range(0, len(items), size)]


@functools.lru_cache(maxsize=1)
def target(target_dir: Path) -> Any:
    """The fp32 target of `target_dir`, loaded once per process."""
    from trainer.data.regenerate import load_target_lm

    model, _ = load_target_lm(str(target_dir), "float32")
    return model


def say_with(prefix: str | None) -> Callable[[str], None] | None:
    """A progress callback for a worker (a lambda does not cross a spawn): lines on this process's stderr."""
    if prefix is None:
        return None
    return lambda line: print(f"{prefix}{line}", file=sys.stderr, flush=True)


def references(
    target_dir: Path, prompts: list[list[int]], common: dict[str, Any], prefix: str | None = None
) -> list[list[int]]:
    """`eval.greedy_references` of `prompts` in a worker (`common`: max_new_tokens, stops, pad_id)."""
    ticker = eval_mod.Ticker(say_with(prefix), len(prompts))
    return eval_mod.greedy_references(target(target_dir), prompts, **common, ticker=ticker)


@dataclass(frozen=True)
class EvalJob:
    """One `eval.evaluate` over `prompts`: the trained drafter, the baselines, or both."""

    prompts: list[list[int]]
    references: list[list[int]]
    trained: bool = True
    baselines: bool = False


def evaluate(
    target_dir: Path,
    drafter: Path | DrafterConfig,
    job: EvalJob,
    block: int | None,
    common: dict[str, Any],
    prefix: str | None = None,
) -> dict[str, Any]:
    """`eval.evaluate` of one job in a worker. `drafter`: an export directory, or a config (the baselines alone
    need only its shape: `evaluate` builds the untrained drafter from it with its own seed)."""
    from trainer.export.export import load_drafter

    model = target(target_dir)
    device = model.get_input_embeddings().weight.device
    loaded = load_drafter(drafter) if isinstance(drafter, Path) else DFlashDrafter(drafter)
    return eval_mod.evaluate(
        model,
        loaded.to(device),
        job.prompts,
        references=job.references,
        trained=job.trained,
        baselines=job.baselines,
        block_size=block,
        progress=say_with(prefix),
        **common,
    )


def submit_evaluation(
    pool: Executor,
    parts: int,
    target_dir: Path,
    drafter: Path | DrafterConfig,
    job: EvalJob,
    block: int | None,
    common: dict[str, Any],
    prefix: str | None = None,
) -> list[Future]:
    """`job`'s prompts cut into `parts` consecutive slices, each submitted to `pool`; `merged` makes them one report."""
    cuts = list(zip(slices(job.prompts, parts), slices(job.references, parts)))
    # Each slice's progress lines say which slice they count (two "3/12 prompts" lines would read as a repeat).
    named = [
        prefix if prefix is None or len(cuts) == 1 else f"{prefix}part {k + 1}/{len(cuts)}: " for k in range(len(cuts))
    ]
    return [
        pool.submit(evaluate, target_dir, drafter, EvalJob(p, r, job.trained, job.baselines), block, common, name)
        for (p, r), name in zip(cuts, named)
    ]


def merged(futures: list[Future]) -> dict[str, Any]:
    """The report of the whole job from its slices' futures (in order)."""
    return eval_mod.merge_reports([future.result() for future in futures])


def joined(report: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Two reports over the same prompts (the trained drafter's and the baselines') as one."""
    if report["prompts"] != other["prompts"]:
        raise ValueError(f"joined: {report['prompts']} prompts against {other['prompts']}")
    methods = {**report["methods"], **other["methods"]}
    return {**report, "methods": methods, "lossless": all(m["lossless"] for m in methods.values())}
