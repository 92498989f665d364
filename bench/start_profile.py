"""Where a trainer's start and a checkpoint's write and read go, piece by piece (issue 19, item 5).

    python bench/start_profile.py                       # 8B-shaped pipeline on cuda:0 (the H200 run)
    .venv/bin/python bench/start_profile.py --scale smoke --device cpu --write-gb 0.2   # CPU smoke run

Four measurements, in one scratch folder (--workdir), each printed as a table at the end:

  imports  `python -X importtime` of what a pipeline run imports (torch, the trainer, transformers): the
           modules with the largest own time and the largest total time
  start    the run of bench/restart_cycle.py's profile (no dflashops), three times: cold compile cache, warm,
           and warm under cProfile; the status.json timeline of the warm run and the cProfile functions with
           the largest cumulative time of the start (everything before the first optimizer step is the main
           thread's, so cProfile sees it)
  write    a checkpoint of --write-gb (one third model in safetensors, two thirds optimizer in torch.save, as
           the 8B drafter's 4.2 + 8.4 GB) written the way trainer.state.checkpoint writes it and in variants: torch's
           zip CRC32 off, the two files side by side; seconds to the data written and to fsync done
  read     trainer.state.checkpoint.load_checkpoint of that checkpoint onto --device, alone and beside a thread
           that holds the GIL in pure Python (as the compile warm-up's tracing does): whether the read can
           overlap the warm-up
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pstats
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from gpu_pipeline import SCALES, write_shards  # noqa: E402
from restart_cycle import START, save_target, train_flags  # noqa: E402

IMPORTS = "import torch, trainer.train, trainer.pipeline_run, transformers; from transformers import AutoConfig"


def run_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def import_table(top: int) -> list[str]:
    """The `top` modules by own and by cumulative import time (microseconds -> ms)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORTS], capture_output=True, text=True, env=run_env(), check=True
    )
    rows = []
    for line in result.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(1)) / 1e3, int(m.group(2)) / 1e3, len(m.group(3)), m.group(4)))
    total = sum(r[0] for r in rows)
    out = [f"all imports: {total:.0f} ms (own times summed)", "by own time:"]
    out += [f"  {own:8.1f} ms  {name}" for own, _, _, name in sorted(rows, reverse=True)[:top]]
    out.append("top-level and second-level modules by cumulative time:")
    shallow = [r for r in rows if r[2] <= 3]
    out += [f"  {cum:8.1f} ms  {name}" for _, cum, _, name in sorted(shallow, key=lambda r: -r[1])[:top]]
    return out


def train(work: Path, scale: dict, device: str, name: str, steps: int, profile: Path | None = None) -> dict:
    """One run of the cycle's profile to `steps` steps; returns its status.json timeline in seconds after spawn."""
    out = work / "runs" / name
    argv = [*train_flags(work, scale, device), "--output-dir", str(out), "--max-steps", str(steps)]
    prefix = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else []) + ["-m", "trainer"]
    spawned = time.time()
    result = subprocess.run([*prefix, "train", *argv], capture_output=True, text=True, env=run_env())
    if result.returncode != 0:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    timeline = json.loads((out / "status.json").read_text())["timeline"]
    marks = {k: round(timeline[k] - spawned, 2) for k in [*START, "engine_imported", "checked"] if k in timeline}
    marks["log"] = [line for line in result.stderr.splitlines() if re.match(r"(built|warm-up|loss kernels)", line)]
    return marks


def profile_table(path: Path, top: int) -> list[str]:
    """The trainer's own functions by cumulative time (where the start goes, phase by phase), then every
    function by own time (what is hot inside them)."""
    lines = []
    for sort, restriction in (("cumulative", "trainer/"), ("tottime", "")):
        stream = io.StringIO()
        stats = pstats.Stats(str(path), stream=stream)
        stats.sort_stats(sort).print_stats(restriction, top) if restriction else stats.sort_stats(sort).print_stats(top)
        body = [line for line in stream.getvalue().splitlines() if re.match(r"\s*[\d/]+\s+\d", line)]
        lines += [f"by {sort}{f' ({restriction})' if restriction else ''}:", *body[:top]]
    return lines


def make_state(gb: float):
    """A model dict and an AdamW-like optimizer state dict of `gb` GB of fp32 in all (1/3 model, 2/3 optimizer)."""
    import torch

    n = max(int(gb * 1e9 / 4 / 3 / 40), 1024)  # 40 tensors of the model's third
    model = {f"layers.{i}.weight": torch.rand(n) for i in range(40)}
    state = {i: {"step": torch.tensor(7.0), "exp_avg": torch.rand(n), "exp_avg_sq": torch.rand(n)} for i in range(40)}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(40))}]
    return model, {"state": state, "param_groups": groups}


def write_variant(directory: Path, model, optimizer, *, crc: bool, parallel: bool) -> tuple[float, float]:
    """(s to the data written, s to both files fsynced) of one checkpoint write."""
    import torch
    import torch.utils.serialization
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = torch.utils.serialization.config.save
    saved_crc = config.compute_crc32
    config.compute_crc32 = crc
    try:
        started = time.perf_counter()
        jobs = [
            lambda: save_file(model, str(directory / "model.safetensors")),
            lambda: torch.save(optimizer, directory / "optimizer.pt"),
        ]
        if parallel:
            with ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(j) for j in jobs]:
                    f.result()
        else:
            for job in jobs:
                job()
        written = time.perf_counter() - started
        for name in ("model.safetensors", "optimizer.pt"):
            with open(directory / name, "rb") as handle:
                os.fsync(handle.fileno())
        return written, time.perf_counter() - started
    finally:
        config.compute_crc32 = saved_crc


class BusyPython:
    """A thread that holds the GIL in pure Python (as dynamo's tracing does) while the `with` block runs;
    `rate` is its loop rate afterwards, in M iterations/s."""

    def __enter__(self) -> BusyPython:
        self.stop, self.count, self.started = threading.Event(), 0, time.perf_counter()
        self.thread = threading.Thread(target=self._spin)
        self.thread.start()
        return self

    def _spin(self) -> None:
        n = 0
        while not self.stop.is_set():
            for _ in range(1000):
                n += 1
        self.count = n

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join()
        self.rate = self.count / (time.perf_counter() - self.started) / 1e6


def read_variant(directory: Path, device: str, busy: bool) -> tuple[float, float]:
    """(s to load the checkpoint onto `device`, the busy thread's Python loop rate in M/s or 0)."""
    import torch

    from trainer.state.checkpoint import load_checkpoint

    with contextlib.ExitStack() as stack:
        hog = stack.enter_context(BusyPython()) if busy else None
        started = time.perf_counter()
        state = load_checkpoint(directory, torch.device(device))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        took = time.perf_counter() - started
    del state
    return took, (hog.rate if hog else 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="8b", choices=sorted(SCALES))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--workdir", default="/tmp/start-profile")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write-gb", type=float, default=12.6)
    parser.add_argument("--parts", default="imports,start,write,read")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="folder for the cProfile file and the full tables")
    args = parser.parse_args()
    scale, work = SCALES[args.scale], Path(args.workdir)
    parts = set(args.parts.split(","))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    report: list[str] = []

    if "imports" in parts:
        report += ["## imports", *import_table(args.top)]
    if "start" in parts:
        if not (work / "data" / "meta.json").exists():
            write_shards(work / "data", scale, samples=scale["rows"] * 2 * 400)
        if not (work / "target" / "config.json").exists():
            save_target(work / "target", scale, args.device)
        stamp = int(time.time())
        rows = {
            "cold": train(work, scale, args.device, f"cold-{stamp}", args.steps),
            "warm": train(work, scale, args.device, f"warm-{stamp}", args.steps),
            "warm, cProfile": train(work, scale, args.device, f"prof-{stamp}", args.steps, out / "start.pstats"),
        }
        report += ["## start (s after spawn)"]
        for label, marks in rows.items():
            report.append(f"{label}: " + ", ".join(f"{k} {v}" for k, v in marks.items() if k != "log"))
            report += [f"    {line}" for line in marks["log"]]
        report += ["cProfile, warm start, by cumulative time:", *profile_table(out / "start.pstats", args.top)]
    checkpoint = work / "checkpoint"
    if "write" in parts or "read" in parts:
        model, optimizer = make_state(args.write_gb)
    if "write" in parts:
        report.append(f"## write, {args.write_gb} GB (s to written / s to fsynced)")
        for crc, parallel in [(True, False), (False, False), (False, True), (True, False)]:
            written, synced = write_variant(checkpoint, model, optimizer, crc=crc, parallel=parallel)
            label = f"crc32 {'on ' if crc else 'off'}, {'side by side' if parallel else 'one after the other'}"
            report.append(f"  {label}: {written:.2f} / {synced:.2f}")
    if "read" in parts:
        if not (checkpoint / "optimizer.pt").exists():
            write_variant(checkpoint, model, optimizer, crc=False, parallel=True)
        import torch

        torch.save({"torch": torch.get_rng_state()}, checkpoint / "rng.pt")
        (checkpoint / "state.json").write_text(json.dumps({"step": 1, "epoch": 0, "index": 0, "scheduler": {}}))
        report.append("## read onto the device (s; the busy thread's loop rate, M/s)")
        for busy in (False, True, False, True):
            took, rate = read_variant(checkpoint, args.device, busy)
            report.append(f"  {'beside a GIL-bound thread' if busy else 'alone'}: {took:.2f} s; {rate:.1f}")
        with BusyPython() as alone:
            time.sleep(1.0)
        alone_rate = alone.rate
        report.append(f"  the loop alone: {alone_rate:.1f} M/s")
    text = "\n".join(report)
    (out / "start_profile.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
