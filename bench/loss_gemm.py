"""The chunked loss's time in GEMM-equivalents across chunk sizes and chunk kernels (eager, compiled, triton).

    python bench/loss_gemm.py --device cuda                      # H200, 27B-style shape, compiled + triton
    python bench/loss_gemm.py --device cuda --rows 32832 --hidden 4096 --vocab 151936 --chunks 1728,4096 \\
        --kernels compiled,triton --terms ce,ce-cap --triton-configs 4096:8:0,16384:16:2 --profile
    .venv/bin/python bench/loss_gemm.py --rows 1024 --vocab 8192 --chunks 128,256 --kernels eager   # CPU smoke

One GEMM-equivalent = one [M, H] x [H, V] logits GEMM in the same dtype. The loss does 2 GEMMs per chunk
for CE (3 with soft labels), so CE-only can reach ~2.0 only when the [C, V] element-wise work (softmax,
gradient, casts) is fused; the goals are CE <= 2.2 and CE+KL <= 3.5 (METHOD.md 7, issue 7). The rows
printed here pick the chunk size for the trainer's `loss_chunk_size` and its `--loss-kernels`. Timing and
inputs come from bench/loss_memory.py (same shapes, same checks; non-eager rows also report their
gradient's relative difference from the eager kernels). "triton" = one fused Triton kernel per chunk for
CE and CE+CAP (trainer/loss_triton.py); with soft labels it runs the compiled kernels, so its ce-kl rows
are skipped. --triton-configs compares launch configs (BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM]) side by side.
--profile: for the first chunk size, the top CUDA kernels of one CE forward+backward per kernel set
(GEMM 1 vs the element-wise kernels vs GEMM 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_memory import make_inputs, measure, parse_args, run_variant  # noqa: E402

from trainer.loss import KERNEL_KINDS, make_chunk_kernels  # noqa: E402  (loss_memory put the repo root on sys.path)

TERMS = ("ce", "ce-cap", "ce-kl", "ce-kl-cap")


def kernel_sets(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(label, kernels) per requested kind; one triton set per --triton-configs entry."""
    sets = []
    for kind in args.kernels.split(","):
        if kind not in KERNEL_KINDS:
            raise SystemExit(f"error: unknown kernels {kind!r}: one of {', '.join(KERNEL_KINDS)}")
        if kind == "triton" and args.triton_configs:
            sets += [(f"triton[{config}]", make_chunk_kernels("triton", triton_config=config))
                     for config in args.triton_configs.split(",")]
        else:
            sets.append((kind, None if kind == "eager" else make_chunk_kernels(kind)))
    return sets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="512,1024,2048,4096", help="comma-separated chunk sizes (rows)")
    parser.add_argument("--kernels", help="comma list of eager, compiled, triton "
                        "(default: cuda compiled,triton; cpu eager)")
    parser.add_argument("--terms", default="ce,ce-kl", help=f"comma list of {', '.join(TERMS)}")
    parser.add_argument("--triton-configs", help="comma list of BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM] for the triton "
                        "kernels (default: $DFLASH_CE_TRITON or the library default)")
    parser.add_argument("--profile", action="store_true",
                        help="top kernels of one CE fwd+bwd per kernel set, at the first chunk size")
    args = parse_args(sys.argv[1:] if argv is None else argv, parser)
    args.kernels = args.kernels or ("compiled,triton" if args.device.startswith("cuda") else "eager")
    terms = args.terms.split(",")
    if any(t not in TERMS for t in terms):
        raise SystemExit(f"error: unknown term in {args.terms!r}: one of {', '.join(TERMS)}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    chunk_sizes = [int(c) for c in args.chunks.split(",")]
    sets = kernel_sets(args)
    print(f"loss GEMM-equivalents: device={device} M={args.rows} H={args.hidden} V={args.vocab} "
          f"B={args.block_size} dtype={args.dtype} repeats={args.repeats}", file=sys.stderr)
    gemm_ms = measure("gemm", args, device)["ms"]
    print(f"{'chunk':>6} {'kernels':<22} {'terms':<10} {'ms':>9} {'GEMM-eq':>8} {'grad diff':>10}", flush=True)
    for chunk in chunk_sizes:
        args.chunk_size = chunk
        for label, kernels in sets:
            for term in terms:
                if label.startswith("triton") and "-kl" in term:
                    continue  # soft labels take the compiled two-kernel path: the compiled row is the number
                prefix = "chunked" if kernels is None else label.split("[")[0]
                row = measure(f"{prefix}-{term}", args, device, kernels)
                diff = row.get("grad_diff_vs_eager")
                diff_text = f"{diff:>10.1e}" if diff is not None else f"{'-':>10}"
                print(f"{chunk:>6} {label:<22} {term:<10} {_ms(row)} {_eq(row, gemm_ms):>8} {diff_text}", flush=True)
    print(f"one logits GEMM: {gemm_ms:.2f} ms; goals: CE <= 2.2, CE+KL <= 3.5 GEMM-eq")
    if args.profile:
        args.chunk_size = chunk_sizes[0]
        for label, kernels in sets:
            profile(label, kernels, args, device, gemm_ms)
    return 0


def profile(label: str, kernels, args: argparse.Namespace, device: torch.device, gemm_ms: float, top: int = 8) -> None:
    """Top kernels by total device time over one CE forward+backward (after a warm-up that compiles)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = make_inputs(args, device)
    name = ("chunked" if kernels is None else label.split("[")[0]) + "-ce"
    cuda = device.type == "cuda"
    run_variant(name, x, args, kernels)  # warm-up: compilation stays out of the trace
    if cuda:
        torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_variant(name, x, args, kernels)
        if cuda:
            torch.cuda.synchronize()

    def total_us(event) -> float:  # kernels: their device time; CPU fallback: self CPU time of the op
        if cuda:
            return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        return event.self_cpu_time_total

    events = sorted(prof.key_averages(), key=total_us, reverse=True)
    everything = sum(total_us(e) for e in events) / 1e3
    print(f"\nprofile {label}, chunk {args.chunk_size}, one CE fwd+bwd: {everything:.1f} ms of "
          f"{'kernels' if cuda else 'CPU ops'} = {everything / gemm_ms:.2f} GEMM-eq")
    print(f"  {'kernel':<70} {'count':>6} {'total ms':>9} {'GEMM-eq':>8}")
    for event in events[:top]:
        ms = total_us(event) / 1e3
        print(f"  {event.key[:70]:<70} {event.count:>6} {ms:>9.2f} {ms / gemm_ms:>8.3f}")
    del x


def _ms(row: dict) -> str:
    return f"{row['ms']:>9.1f}" if row["ms"] is not None else f"{'OOM':>9}"


def _eq(row: dict, gemm_ms: float) -> str:
    return f"{row['ms'] / gemm_ms:.2f}" if row["ms"] is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
