"""Cost of building the flex BlockMask (compile-free tile classifier in trainer.model.attention) at a real shape.

    python bench/block_mask_cost.py [--device cpu|cuda:0] [--rows 6 --ctx 8192 --anchors 171 --block 32]

Defaults are the qwen3-8b seed shape (Q = 171*32 = 5472, K = 8192 + 5472 = 13664; neither a multiple of 128).
For each layer type it prints the wall time of one row and of all rows, and the peak memory of building it:
on CUDA torch.cuda.max_memory_allocated above the inputs; on CPU the growth of the process's peak RSS
(ru_maxrss), a high-water mark: each line shows the largest build so far. Run it with
MALLOC_MMAP_THRESHOLD_=131072 so glibc maps every large tensor separately and unmaps it on free; otherwise
heap fragmentation inflates the CPU figure.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model.attention import _flex_block_mask


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(
    anchors: torch.Tensor, keep: torch.Tensor, ctx: int, block: int, window: int | None, device: torch.device
) -> tuple[float, int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_bytes(device) if device.type == "cuda" else BASELINE
    start = time.perf_counter()
    mask = _flex_block_mask(anchors, keep, ctx, block, window=window, causal=window is not None, doc_ids=None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del mask
    return seconds, peak_bytes(device) - before


def main() -> int:
    global BASELINE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--anchors", type=int, default=171)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    anchors = torch.randint(1, args.ctx, (args.rows, args.anchors), generator=gen).sort(dim=1).values.to(device)
    keep = torch.ones(args.rows, args.anchors, dtype=torch.bool, device=device)
    keep[:, -args.anchors // 10 :] = False  # some padded blocks
    q_len = args.anchors * args.block
    print(
        f"device={device} threads={torch.get_num_threads()} R={args.rows} S={args.ctx} N={args.anchors} "
        f"B={args.block} Q={q_len} K={args.ctx + q_len}",
        file=sys.stderr,
    )
    # Page in the kernels' code (and CUDA context) on a small build first so the baseline excludes them.
    _flex_block_mask(anchors[:1, :8], keep[:1, :8], 300, args.block, window=args.window, causal=True, doc_ids=None)
    BASELINE = peak_bytes(device)
    for name, window in (("full", None), ("sliding", args.window)):
        for rows in (1, args.rows):
            seconds, peak = measure(anchors[:rows], keep[:rows], args.ctx, args.block, window, device)
            print(f"{name:8s} rows={rows}: {seconds * 1e3:8.1f} ms   peak +{peak / 2**20:7.1f} MiB")
    return 0


BASELINE = 0

if __name__ == "__main__":
    sys.exit(main())
