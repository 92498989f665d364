"""The chunked loss's time in GEMM-equivalents across chunk sizes, eager vs torch.compile'd chunk kernels.

    python bench/loss_gemm.py --device cuda                      # H200, 27B-style shape, compiled + eager
    .venv/bin/python bench/loss_gemm.py --rows 1024 --vocab 8192 --chunks 128,256 --no-compiled   # CPU smoke

One GEMM-equivalent = one [M, H] x [H, V] logits GEMM in the same dtype. The loss does 2 GEMMs per chunk
for CE (3 with soft labels), so CE-only can reach ~2.0 only when the [C, V] element-wise work (softmax,
gradient, casts) is fused; the goals are CE <= 2.2 and CE+KL <= 3.5 (METHOD.md 7, issue 7). The rows
printed here pick the chunk size for the trainer's `loss_chunk_size`. Timing and inputs come from
bench/loss_memory.py (same shapes, same checks; compiled rows also report their gradient's relative
difference from the eager kernels).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_memory import measure, parse_args  # noqa: E402

from trainer.loss import make_chunk_kernels  # noqa: E402  (loss_memory put the repo root on sys.path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="512,1024,2048,4096", help="comma-separated chunk sizes (rows)")
    parser.add_argument("--no-compiled", action="store_true", help="eager kernels only")
    args = parse_args(sys.argv[1:] if argv is None else argv, parser)
    use_compiled = not args.no_compiled
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    chunk_sizes = [int(c) for c in args.chunks.split(",")]
    print(f"loss GEMM-equivalents: device={device} M={args.rows} H={args.hidden} V={args.vocab} "
          f"B={args.block_size} dtype={args.dtype} repeats={args.repeats}", file=sys.stderr)
    gemm_ms = measure("gemm", args, device)["ms"]
    kernel_sets = [("eager", None, "chunked")]
    if use_compiled:
        kernel_sets.append(("compiled", make_chunk_kernels(compiled=True), "compiled"))
    print(f"{'chunk':>6} {'kernels':>9} {'CE ms':>9} {'CE eq':>6} {'CE+KL ms':>9} {'CE+KL eq':>9} {'grad diff':>10}")
    for chunk in chunk_sizes:
        args.chunk_size = chunk
        for label, kernels, prefix in kernel_sets:
            ce = measure(f"{prefix}-ce", args, device, kernels)
            kl = measure(f"{prefix}-ce-kl", args, device, kernels)
            diff = max((r.get("grad_diff_vs_eager") or 0.0) for r in (ce, kl))
            print(f"{chunk:>6} {label:>9} {_ms(ce)} {_eq(ce, gemm_ms)} {_ms(kl)} {_eq(kl, gemm_ms):>9} "
                  f"{diff:>10.1e}", flush=True)
    print(f"one logits GEMM: {gemm_ms:.2f} ms; goals: CE <= 2.2, CE+KL <= 3.5 GEMM-eq")
    return 0


def _ms(row: dict) -> str:
    return f"{row['ms']:>9.1f}" if row["ms"] is not None else f"{'OOM':>9}"


def _eq(row: dict, gemm_ms: float) -> str:
    return f"{row['ms'] / gemm_ms:>6.2f}" if row["ms"] is not None else f"{'-':>6}"


if __name__ == "__main__":
    sys.exit(main())
