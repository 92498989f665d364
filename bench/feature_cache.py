"""`train --feature-cache` on the CPU: the real-model demo's training, N steps without the cache and N steps reading a
warm cache (filled by a first run), interleaved A B A B, wall time and block tokens/s of each, load noted.

    python bench/feature_cache.py --data DIR --target DIR --steps 20 --repeats 2

DIR: the demo's regenerated dataset and converted model (`make demo-real` leaves links to both in
demo-workspace/real-world/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainer import real_demo, train


def one(target: Path, data: Path, out: Path, steps: int, cache: Path | None) -> dict[str, float]:
    size = real_demo.size_with(real_demo.FULL, train_steps=steps)
    argv = real_demo.train_argv(target, data, out, 16, size, "dflash")
    argv += ["--log-interval", str(steps)] + (["--feature-cache", str(cache)] if cache else [])
    load, started = os.getloadavg()[0], time.monotonic()
    assert train.main(argv) == 0
    seconds = time.monotonic() - started
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    blocks = sum(int(m.get("blocks", 0)) for m in metrics)
    shutil.rmtree(out)
    return {"seconds": round(seconds, 1), "block_tok_s": round(blocks * size.block_size / seconds, 1), "load": load}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fcache-bench-"))
    cache = work / "cache"
    fill = one(args.target, args.data, work / "fill", args.steps, cache)
    print(f"fill (computes and stores): {fill}", flush=True)
    rows = []
    for _ in range(args.repeats):
        rows.append(("off", one(args.target, args.data, work / "off", args.steps, None)))
        rows.append(("warm", one(args.target, args.data, work / "warm", args.steps, cache)))
        print(rows[-2], rows[-1], flush=True)
    for name in ("off", "warm"):
        secs = [r["seconds"] for n, r in rows if n == name]
        print(f"{name}: {args.steps} steps in {secs} s (median {sorted(secs)[len(secs) // 2]})")
    print(f"cache size: {sum(p.stat().st_size for p in cache.rglob('*.npy')) / 1e6:.0f} MB")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
