"""How long training stops for a checkpoint: synchronous save against snapshot + background write.

    python bench/checkpoint_pause.py                          # qwen3-8b drafter on cuda:0 (the GPU machine)
    .venv/bin/python bench/checkpoint_pause.py --preset tiny --device cpu   # this script's own smoke test

Builds the preset's drafter as the trainer does (fp32 master weights under bf16 autocast, AdamW with its two
moments materialised by one step), then times, each `--repeats` times into a fresh directory:
  save      `save_checkpoint`: what a save cost the training loop before the background writer (skip with
            --no-sync-save);
  snapshot  `CheckpointWriter.snapshot`: the device->host copy, all the loop waits for now; the first one
            allocates the (pinned) host buffers, later ones reuse them;
  write     the background write of that snapshot: the part that overlaps training.
Prints one table; the sizes are what lands on disk.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.bench.bench_common import SHAPES, preset_config  # noqa: E402
from trainer.model import DFlashDrafter  # noqa: E402
from trainer.state.checkpoint import CheckpointWriter, save_checkpoint  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-sync-save", action="store_true", help="skip the synchronous save (known: 20.7 s)")
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
    print(
        f"{args.preset} drafter on {device}: {sum(p.numel() for p in params) / 1e9:.2f} B trainable parameters, "
        f"{weight_gb:.1f} GB of weights, {2 * weight_gb:.1f} GB of AdamW moments",
        file=sys.stderr,
        flush=True,
    )

    def parts() -> dict:
        return dict(
            model=drafter.state_dict(),
            optimizer=optimizer.state_dict(),
            scheduler={"last_epoch": 0},
            epoch=0,
            index=0,
            extra={},
        )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {"save": [], "snapshot": [], "write": []}
    root = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-pause-"))
    with CheckpointWriter(root / "async", keep=1) as writer:
        for repeat in range(args.repeats):
            if not args.no_sync_save:
                sync()
                started = time.perf_counter()
                save_checkpoint(root / f"sync-{repeat}", 1, keep=1, **parts())
                times["save"].append(time.perf_counter() - started)
            sync()
            started = time.perf_counter()
            snapshot = writer.snapshot(repeat + 1, **parts())
            times["snapshot"].append(time.perf_counter() - started)
            started = time.perf_counter()
            writer.submit(snapshot)
            del snapshot
            writer.wait()
            times["write"].append(time.perf_counter() - started)
            print(
                f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v),
                file=sys.stderr,
                flush=True,
            )
    on_disk = sum(f.stat().st_size for f in (root / "async" / "checkpoints").rglob("*") if f.is_file()) / 1e9
    show = lambda values: ", ".join(f"{v:.2f}" for v in values) or "-"  # noqa: E731
    print(
        "| preset | device | on disk GB | save s (old pause) | snapshot s (new pause; 1st allocates) | "
        "background write s |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.preset} | {device} | {on_disk:.1f} | {show(times['save'])} | {show(times['snapshot'])} | "
        f"{show(times['write'])} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
