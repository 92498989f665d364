"""How long training stops for a checkpoint: synchronous save against snapshot + background write.

    python bench/checkpoint_pause.py                          # qwen3-8b drafter on cuda:0 (the GPU machine)
    .venv/bin/python bench/checkpoint_pause.py --preset tiny --device cpu   # this script's own smoke test

Builds the preset's drafter as the trainer does (fp32 master weights under bf16 autocast, AdamW with its two
moments materialised by one step), then times, each `--repeats` times into a fresh directory:
  save      `save_checkpoint`: what a save cost the training loop before the background writer;
  snapshot  `snapshot_checkpoint`: the device->host copy, all the loop waits for now;
  write     `write_checkpoint` of that snapshot: the part that now overlaps training.
Prints one table, the medians; the sizes are what lands on disk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.bench_common import SHAPES, preset_config  # noqa: E402
from trainer.checkpoint import save_checkpoint, snapshot_checkpoint, write_checkpoint  # noqa: E402
from trainer.model import DFlashDrafter  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg, dcfg = preset_config(args.preset, SHAPES["seed"], [])
    with torch.device(device):
        drafter = DFlashDrafter(dcfg)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # materialises exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    weight_gb = sum(p.numel() * p.element_size() for p in params) / 1e9
    print(f"{args.preset} drafter on {device}: {sum(p.numel() for p in params) / 1e9:.2f} B trainable parameters, "
          f"{weight_gb:.1f} GB of weights, {2 * weight_gb:.1f} GB of AdamW moments", file=sys.stderr, flush=True)

    def parts() -> dict:
        return dict(model=drafter.state_dict(), optimizer=optimizer.state_dict(), scheduler={"last_epoch": 0},
                    epoch=0, index=0, extra={})

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {"save": [], "snapshot": [], "write": []}
    root = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-pause-"))
    for repeat in range(args.repeats):
        sync()
        started = time.perf_counter()
        save_checkpoint(root / f"sync-{repeat}", 1, keep=1, **parts())
        times["save"].append(time.perf_counter() - started)
        sync()
        started = time.perf_counter()
        snapshot = snapshot_checkpoint(1, **parts())
        times["snapshot"].append(time.perf_counter() - started)
        started = time.perf_counter()
        write_checkpoint(root / f"async-{repeat}", snapshot, keep=1)
        times["write"].append(time.perf_counter() - started)
        del snapshot
        print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), file=sys.stderr,
              flush=True)
    on_disk = sum(f.stat().st_size for f in (root / "sync-0" / "checkpoints").rglob("*") if f.is_file()) / 1e9
    print("| preset | device | on disk GB | save s (old pause) | snapshot s (new pause) | background write s |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.preset} | {device} | {on_disk:.1f} | {statistics.median(times['save']):.2f} | "
          f"{statistics.median(times['snapshot']):.2f} | {statistics.median(times['write']):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
