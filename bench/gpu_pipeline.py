"""Threaded pipeline on one GPU: one target thread + two drafter threads on cuda:0 against one drafter thread.

Run on the GPU machine from the repository root (no weights or data needed; everything is built here):

    python bench/gpu_pipeline.py                      # 8B-shaped drafter, 200 steps, each mode once, cold cache
    python bench/gpu_pipeline.py --repeats 10 --modes dual   # the "ten times in a row" check
    python bench/gpu_pipeline.py --scale small --steps 50     # a quick look (1K hidden, 32K vocab)
    python bench/gpu_pipeline.py --scale specforge --modes dual --steps 80 --warm-cache   # issue 31 item 4
    .venv/bin/python bench/gpu_pipeline.py --scale smoke --device cpu --steps 20   # this script's own smoke test

`--scale specforge` is SpecForge's published shape on one GPU: a full-depth random Qwen3-8B-shaped target (36
layers, bf16) and the drafter threads on the same device, 2 rows x 768 tokens, 256 anchors x 16 per micro-batch;
its `samples/s` column (sequences trained per second on the GPU, from metrics.jsonl's context tokens/s, the first
logged window skipped) is the number to hold against SpecForge's ~6.3 samples/s per GPU.

Each run is a fresh child process (`--child`) with its own empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR
(a cold compile cache; `--warm-cache` shares one directory instead), driving trainer.pipeline_run.run_pipeline
on fixed-length token shards written here, so every micro-batch has the same shape: one compile per drafter
device, done in the warm-up. The child reports: warm-up seconds, dynamo compile counters after warm-up and at
the end (any difference is a recompile; the pipeline's CompileGuard would also have failed the run), whether
the FX-tracing error or the eager-flex warning appeared, and the steady-state throughput from metrics.jsonl
(first logged window skipped). Prints one table row per run; exit status 1 if any run failed or recompiled.

Predictions (to check against the table): per-drafter block tok/s with two drafter threads on ONE GPU is at most
half the single-thread figure (they share the SMs); the interesting number is the SUM against the single thread:
below 1.0x means GIL/launch overhead costs more than the overlap of two streams gains.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Job(NamedTuple):
    """One child run: a point of the settings' grid (each comma list of the command line is one axis)."""

    repeat: int
    mode: str
    transfer: str
    engine: str
    adamw: str
    wait: str
    target_compile: str
    attention: str


SCALES = {
    # Qwen3-8B drafter shape; the target keeps the 8B layer shape but only 6 layers (taps 0..4) to load fast.
    "8b": dict(
        hidden=4096,
        intermediate=12288,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        target_layers=6,
        draft_layers=5,
        seq=1024,
        rows=4,
        anchors=256,
        block=16,
    ),
    "small": dict(
        hidden=1024,
        intermediate=3072,
        heads=16,
        kv_heads=8,
        head_dim=64,
        vocab=32000,
        target_layers=6,
        draft_layers=5,
        seq=1024,
        rows=4,
        anchors=256,
        block=16,
    ),
    # SpecForge's published shape (issue 31 item 4): a full-depth random Qwen3-8B-shaped target (36 layers, taps
    # at the default [1, 9, 17, 25, 33]: layers 34-35 exist but never run, TargetModel exits after the highest tap),
    # 2 rows x 768 tokens per micro-batch, 256 anchors x block 16 per row, one micro-batch per drafter per step.
    "specforge": dict(
        hidden=4096,
        intermediate=12288,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        target_layers=36,
        draft_layers=5,
        seq=768,
        rows=2,
        anchors=256,
        block=16,
        taps=None,
    ),
    # the specforge scale's structure (default taps of a deeper target, 2 rows) at CPU size: its smoke test
    "specforge-smoke": dict(
        hidden=64,
        intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=512,
        target_layers=12,
        draft_layers=3,
        seq=96,
        rows=2,
        anchors=16,
        block=4,
        taps=None,
    ),
    # CPU smoke test of this script only: python bench/gpu_pipeline.py --child --scale smoke --device cpu ...
    "smoke": dict(
        hidden=64,
        intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=512,
        target_layers=6,
        draft_layers=5,
        seq=128,
        rows=2,
        anchors=8,
        block=4,
    ),
}
MODES = {"single": 1, "dual": 2}


def write_shards(directory: Path, scale: dict, samples: int, seed: int = 0) -> None:
    """Fixed-length samples (all = --max-seq-len), prompt of 64 unsupervised tokens: one batch shape only."""
    from trainer.data.shards import DatasetMeta, write_index, write_shard

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(samples):
        ids = rng.integers(0, min(scale["vocab"] - 2, 30000), size=scale["seq"])
        mask = np.ones(scale["seq"], np.uint8)
        mask[:64] = 0
        rows.append((ids, mask))
    entry = write_shard(directory, "shard-00000", rows)
    write_index(directory, [entry], DatasetMeta(tokenizer="synthetic", vocab_size=scale["vocab"]))


def target_shape(scale: dict) -> dict:
    """Qwen3Config keyword arguments of a scale's random target."""
    return dict(
        num_hidden_layers=scale["target_layers"],
        hidden_size=scale["hidden"],
        intermediate_size=scale["intermediate"],
        num_attention_heads=scale["heads"],
        num_key_value_heads=scale["kv_heads"],
        head_dim=scale["head_dim"],
        vocab_size=scale["vocab"],
        max_position_embeddings=40960,
    )


def shape_flags(scale: dict) -> list[str]:
    """`python -m trainer train` flags for a scale's drafter, data shape and schedule (the target's shape is
    the caller's: a tiny_target config, or a saved model, bench/restart_cycle.py)."""
    return [
        "--epochs",
        "50",
        "--hidden-size",
        str(scale["hidden"]),
        "--intermediate-size",
        str(scale["intermediate"]),
        "--num-attention-heads",
        str(scale["heads"]),
        "--num-key-value-heads",
        str(scale["kv_heads"]),
        "--head-dim",
        str(scale["head_dim"]),
        "--vocab-size",
        str(scale["vocab"]),
        "--mask-token-id",
        str(scale["vocab"] - 1),
        "--num-target-layers",
        str(scale["target_layers"]),
        "--num-draft-layers",
        str(scale["draft_layers"]),
        *(["--target-layer-ids", scale.get("taps", "0,1,2,3,4")] if scale.get("taps", "") is not None else []),
        "--max-seq-len",
        str(scale["seq"]),
        "--token-budget",
        str(scale["seq"] * scale["rows"]),
        "--max-batch-size",
        str(scale["rows"]),
        "--anchors-per-seq",
        str(scale["anchors"]),
        "--max-anchors",
        str(scale["anchors"] * scale["rows"]),
        "--block-size",
        str(scale["block"]),
        "--gamma",
        "7",
        "--rope-theta",
        "1000000",
        "--max-position-embeddings",
        "40960",
    ]


def child(args: argparse.Namespace) -> int:
    """One run in this process; prints one JSON line with the results."""
    import torch

    from trainer.core.config import parse_train_args
    from trainer.model import default_target_layer_ids
    from trainer.pipeline.compile_guard import compile_counts
    from trainer.pipeline_run import PipelineOptions, run_pipeline

    scale = SCALES[args.scale]
    work = Path(args.workdir)
    data = work / "data"
    drafters = MODES[args.mode]
    if not (data / "meta.json").exists():
        write_shards(data, scale, samples=scale["rows"] * 32 * max(2, (args.steps * drafters) // 32 + 2))
    argv = [
        "--preset",
        "tiny",
        "--data-dir",
        str(data),
        "--output-dir",
        str(work / "run"),
        "--wandb",
        "off",
        "--target-gpus",
        args.device,
        "--drafter-gpus",
        ",".join([args.device] * drafters),
        "--pipeline",
        "--max-steps",
        str(args.steps),
        "--log-interval",
        "10",
        "--save-interval",
        str(10**9),
        *shape_flags(scale),
        "--loss-kernels",
        args.loss_kernels,
        "--adamw",
        args.adamw,
        "--target-compile",
        args.target_compile,
        "--attention-kernel",
        args.attention_kernel,
    ]
    cfg = parse_train_args(argv)
    cfg.tiny_target = target_shape(scale)
    cfg.validate()
    seen: dict = {}

    def on_warmup(report) -> None:
        seen["warmup_s"] = report.total_s
        seen["after_warmup"] = compile_counts()
        seen["warmup_done_at"] = time.monotonic()

    def on_step(step: int, sides) -> None:
        seen["at_end"] = compile_counts()
        seen["steps"] = step
        seen["last_step_at"] = time.monotonic()

    started = time.monotonic()
    options = PipelineOptions(feature_transfer=args.transfer, on_warmup=on_warmup, on_step=on_step)
    if args.engine == "dist":  # this child runs under torchrun (one node): the distributed engine, NCCL on CUDA
        from trainer.distributed_run import run_distributed

        code = run_distributed(cfg, options)
    else:
        code = run_pipeline(cfg, options)
    ended = time.monotonic()
    warm_done, last_step = seen.get("warmup_done_at", ended), seen.get("last_step_at", ended)
    phases = {
        "build_s": round(warm_done - started - seen.get("warmup_s", 0.0), 1),  # models, copies, data
        "steps_s": round(last_step - warm_done, 1),
        "final_save_s": round(ended - last_step, 1),
    }
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:] or records
    recompiles = sum(
        seen.get("at_end", {}).get(k, 0) - seen.get("after_warmup", {}).get(k, 0) for k in seen.get("after_warmup", {})
    )
    result = {
        "engine": args.engine,
        "mode": args.mode,
        "drafters": drafters,
        "transfer": args.transfer,
        "exit_code": code,
        "adamw": args.adamw,
        "target_compile": args.target_compile,
        "attention_kernel": args.attention_kernel,
        "target_layers": scale["target_layers"],
        "taps": cfg.target_layer_ids or default_target_layer_ids(scale["target_layers"], scale["draft_layers"]),
        "warmup_s": round(seen.get("warmup_s", float("nan")), 1),
        "steps": seen.get("steps", 0),
        "wall_s": round(time.monotonic() - started, 1),
        "recompiles_after_warmup": recompiles,
        "block_tok_s": round(statistics.median(r["block_tok_s"] for r in steady)) if steady else 0,
        # samples (sequences) trained per second on this one GPU (target and drafters share it): every sample is
        # exactly `seq` real tokens, so context tokens / seq; SpecForge's published system: ~6.3 per GPU
        "samples_s": round(statistics.median(r["ctx_tok_s"] for r in steady) / scale["seq"], 2) if steady else 0.0,
        # the main thread's replica sync per step (the drafters wait for it; the target thread may run meanwhile)
        "sync_ms": round(statistics.median(r.get("sync_s_per_step", 0.0) for r in steady) * 1e3, 2) if steady else 0.0,
        "busy_tok_s_per_drafter": [
            round(statistics.median(r["block_tok_s_per_drafter"][d] for r in steady)) for d in range(drafters)
        ]
        if steady
        else [],
        "gpu_mem_gb": steady[-1].get("gpu_mem_gb") if steady else None,
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]] if records else None,
        # every 50 steps and at the end; --sync grad fails the run itself if they ever differ
        "replica_checksum_steps": [r["step"] for r in records if len(set(r.get("replica_checksums", ["?", "!"]))) == 1],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        **phases,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="8b")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", default="single,dual", help="comma list of single,dual")
    parser.add_argument("--transfers", default="device", help="comma list of device,pinned")
    parser.add_argument(
        "--engines",
        default="threaded",
        help="comma list of threaded (run_pipeline in the process) and dist (the distributed engine, "
        "one node under torchrun: NCCL on CUDA, gloo on the CPU)",
    )
    parser.add_argument("--loss-kernels", default="auto", help="passed to the trainer (auto, compiled, triton)")
    parser.add_argument(
        "--adamw", default="auto", help="comma list, each passed to the trainer (auto, fused, foreach, triton)"
    )
    parser.add_argument(
        "--target-compile",
        default="auto",
        help="comma list of auto,on,off: the target's layers through one compiled call (the trainer's "
        "--target-compile; auto, its default, is on for a CUDA target)",
    )
    parser.add_argument(
        "--attention-kernel",
        default="flex",
        help="comma list of flex,triton: the drafters' attention (the trainer's --attention-kernel)",
    )
    parser.add_argument(
        "--sync-wait",
        default="stream",
        help="comma list of how the replica sync waits ($DFLASH_SYNC_WAIT: device, stream; trainer/pipeline/replica_sync.py)",
    )
    parser.add_argument("--warm-cache", action="store_true", help="share one compile cache across runs")
    parser.add_argument("--timeout-s", type=float, default=1200, help="per run")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs side by side (each still from its own cold cache); throughput only means something at 1",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no new run once this much time has passed (0: no limit); fits a run time limit",
    )
    parser.add_argument(
        "--log-dir",
        default=os.environ.get("OUT", ""),
        help="each run's stderr goes to LOG_DIR/pipeline-MODE-TRANSFER-N.log (default $OUT, else the run's workdir)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="dual", help=argparse.SUPPRESS)
    parser.add_argument("--transfer", default="device", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="threaded", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="0", help="CUDA index (default 0), or cpu for a smoke test of this script")
    args = parser.parse_args()
    if args.child:
        return child(args)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("error: no CUDA device (this benchmark needs one GPU)", file=sys.stderr)
        return 2
    shared_cache = Path(tempfile.mkdtemp(prefix="bench-pipeline-cache-"))
    jobs = [
        Job(repeat, mode, transfer, engine, adamw, wait, tc, attention)
        for repeat in range(args.repeats)
        for engine in args.engines.split(",")
        for mode in args.modes.split(",")
        for transfer in args.transfers.split(",")
        for adamw in args.adamw.split(",")
        for wait in args.sync_wait.split(",")
        for tc in args.target_compile.split(",")
        for attention in args.attention_kernel.split(",")
    ]
    rows, failed, began = [], False, time.monotonic()
    running: list[tuple[Job, subprocess.Popen, Path, float, Path]] = []
    print(
        "run engine   mode   drafters transfer adamw   wait   tc  attn   warmup_s steps recompiles block_tok/s per_drafter samples/s "
        "sync_ms busy_tok/s/drafter  build_s steps_s save_s result",
        flush=True,
    )
    while jobs or running:
        # Start runs while a slot is free (--parallel) and the budget allows; each is a fresh process with its
        # own empty compile cache. Runs side by side share the GPU: their throughput is not the single-run figure.
        while jobs and len(running) < args.parallel:
            if args.budget_s and time.monotonic() - began > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {len(jobs)} run(s) not started", flush=True)
                failed, jobs = True, []
                break
            job = jobs.pop(0)
            running.append(_start_run(job, args, shared_cache))
        for entry in list(running):
            job, proc, log_path, started, work = entry
            timed_out = time.monotonic() - started > args.timeout_s
            if proc.poll() is None and not timed_out:
                continue
            running.remove(entry)
            if timed_out and proc.poll() is None:
                proc.kill()
            stdout = proc.stdout.read() if proc.stdout else ""
            proc.wait()
            stderr = log_path.read_text(errors="replace")
            if args.log_dir:  # the log lives there: the run's data, checkpoints and cache go (~MBs a smoke run)
                shutil.rmtree(work, ignore_errors=True)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            fx_error = "symbolically trace a dynamo-optimized function" in stderr
            flex_eager = "flex_attention called without torch.compile" in stderr
            if line is None:
                failed = True
                why = f"timed out after {args.timeout_s:.0f} s" if timed_out else f"exit {proc.returncode}"
                print(
                    f"{job.repeat:3} {job.engine:8} {job.mode:6} FAILED ({why}); {log_path} tail:\n{stderr[-3000:]}",
                    flush=True,
                )
                continue
            r = json.loads(line[len("RESULT ") :])
            ok = r["exit_code"] == 0 and r["recompiles_after_warmup"] == 0 and not fx_error and not flex_eager
            failed |= not ok
            rows.append({"repeat": job.repeat, "sync_wait": job.wait, **r})
            per = r["block_tok_s"] / r["drafters"]
            print(
                f"{job.repeat:3} {job.engine:8} {job.mode:6} {r['drafters']:8} {job.transfer:8} {job.adamw:7} {job.wait:6} "
                f"{job.target_compile:3} {job.attention:6} {r['warmup_s']:8} "
                f"{r['steps']:5} {r['recompiles_after_warmup']:10} {r['block_tok_s']:11,} {per:11,.0f} "
                f"{r['samples_s']:9.2f} {r['sync_ms']:7.1f} "
                f"{r['busy_tok_s_per_drafter']!s:20} {r['build_s']:7} {r['steps_s']:7} {r['final_save_s']:6} "
                f"{'ok' if ok else 'FAIL'}{' FX-error' if fx_error else ''}{' eager-flex' if flex_eager else ''}",
                flush=True,
            )
            if (
                not ok
            ):  # the run's own error (a traceback, CompileGuardError, ReplicaDivergenceError) in the table's log
                print(f"    {log_path} tail:\n{stderr[-1500:]}", flush=True)
        time.sleep(0.5)
    shutil.rmtree(shared_cache, ignore_errors=True)
    print(json.dumps(rows))
    return 1 if failed else 0


def _start_run(
    job: Job, args: argparse.Namespace, shared_cache: Path
) -> tuple[Job, subprocess.Popen, Path, float, Path]:
    """Launch one child run; its stderr streams to a log file, so a run cut off still shows how far it got."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-pipeline-{job.mode}-"))
    cache = shared_cache if args.warm_cache else work / "compile-cache"
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "DFLASH_SYNC_WAIT": job.wait,
    }
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--scale",
        args.scale,
        "--steps",
        str(args.steps),
        "--mode",
        job.mode,
        "--transfer",
        job.transfer,
        "--workdir",
        str(work),
        "--device",
        args.device,
        "--loss-kernels",
        args.loss_kernels,
        "--adamw",
        job.adamw,
        "--target-compile",
        job.target_compile,
        "--attention-kernel",
        job.attention,
        "--engine",
        job.engine,
    ]
    if job.engine == "dist":  # one node: torchrun's static rendezvous on a free loopback port
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            *cmd[1:],
        ]
    settings = (job.engine, job.mode, job.transfer, job.adamw, job.wait, f"tc{job.target_compile}", job.attention)
    log_path = Path(args.log_dir or work) / f"pipeline-{'-'.join(settings)}-{job.repeat}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True
        )
    return job, proc, log_path, time.monotonic(), work


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
