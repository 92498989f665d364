"""The chunked loss's time in GEMM-equivalents: CE and CE+KL, compiled vs Triton chunk kernels, side by side.

    # issue 19, the qwen3-8b seed shape on the H200 (CE, CE+KL, CE+KL+CAP; the seed's --kl-weight 0.15
    # --kl-temperature 2.0 are the defaults here):
    python bench/loss_gemm.py --device cuda --rows 32832 --hidden 4096 --vocab 151936 --block-size 32 \\
        --chunks 4096,1728 --kernels compiled,triton --terms ce,ce-kl,ce-kl-cap \\
        --kl-triton-configs 1024:4:0,2048:4:0,2048:8:0,512:4:0,4096:16:0,4096:16:1 --repeats 5 --profile
    python bench/loss_gemm.py --device cuda                      # 27B-style shape, compiled + triton
    .venv/bin/python bench/loss_gemm.py --rows 1024 --vocab 8192 --chunks 128,256 --kernels eager   # CPU smoke

One GEMM-equivalent = one [M, H] x [H, V] logits GEMM in the same dtype, timed here on the same inputs. The
loss does 2 GEMMs per chunk for CE and 3 with soft labels (the teacher's logits), so CE can approach 2.0 and
CE+KL 3.0 only as far as the [C, V] element-wise work between the GEMMs is fused (goals: CE <= 2.2, issue 7;
CE+KL <= 3.3, issue 19). "triton" = the fused Triton kernels: trainer/kernels/loss_triton.py for CE and CE+CAP
(launch configs from --triton-configs), trainer/kernels/loss_triton_kl.py for CE+KL and CE+KL+CAP (--kl-triton-configs;
BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM] each). Every row is checked against the eager kernels on the same inputs
first (relative L2 difference of the gradient, relative difference of the loss); "peak GiB" is the device
memory above the inputs. --profile: at the first chunk size, the top kernels of one forward+backward per
kernel set for CE and CE+KL (GEMMs vs the element-wise kernels). The last thing printed is a summary table:
the best row per (term, kernels) against the goals. Runs on torch >= 2.4 and triton >= 3.0 (H200: 2.11 / 3.6).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_memory import make_inputs, parse_args

# loss_memory put the repo root on sys.path
from trainer.training.loss import KERNEL_KINDS, ChunkKernels, dflash_loss, make_chunk_kernels

TERMS = ("ce", "ce-cap", "ce-kl", "ce-kl-cap")
GOALS = {"ce": 2.2, "ce-cap": 2.2, "ce-kl": 3.3, "ce-kl-cap": 3.3}  # GEMM-eq (issue 7 for CE, issue 19 for KL)
FLOORS = {"ce": 2, "ce-cap": 2, "ce-kl": 3, "ce-kl-cap": 3}  # GEMMs per chunk


def kernel_sets(args: argparse.Namespace, term: str) -> list[tuple[str, ChunkKernels | None]]:
    """(label, kernels) per requested kind for one term; one triton set per launch config of the kernel this
    term runs (--triton-configs for CE terms, --kl-triton-configs for soft-label terms)."""
    sets: list[tuple[str, ChunkKernels | None]] = []
    soft = "-kl" in term
    for kind in args.kernels.split(","):
        if kind not in KERNEL_KINDS:
            raise SystemExit(f"error: unknown kernels {kind!r}: one of {', '.join(KERNEL_KINDS)}")
        configs = (args.kl_triton_configs if soft else args.triton_configs) if kind == "triton" else None
        if configs:
            for config in configs.split(","):
                kernels = (
                    make_chunk_kernels("triton", kl_triton_config=config)
                    if soft
                    else make_chunk_kernels("triton", triton_config=config)
                )
                sets.append((f"triton[{config}]", kernels))
        else:
            sets.append((kind, None if kind == "eager" else make_chunk_kernels(kind)))
    return sets


def run_loss(term: str, x: dict, args: argparse.Namespace, kernels: ChunkKernels | None) -> torch.Tensor:
    """One forward + backward of the loss with ``term``'s parts (the gradient lands in x["hidden"].grad)."""
    x["hidden"].grad = None
    use_kl, use_cap = "-kl" in term, term.endswith("cap")
    result = dflash_loss(
        x["hidden"],
        x["weight"],
        x["labels"],
        x["weights"],
        block_size=args.block_size,
        normalizer=x["normalizer"],
        teacher_hidden=x["teacher"] if use_kl else None,
        kl_weight=args.kl_weight if use_kl else 0.0,
        kl_temperature=args.kl_temperature,
        cap_lambda=args.cap_lambda if use_cap else 0.0,
        num_blocks_normalizer=x["blocks"],
        chunk_size=args.chunk_size,
        kernels=kernels,
    )
    result.loss.backward()
    return result.loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, each between device syncs (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_row(
    term: str, kernels: ChunkKernels | None, x: dict, args: argparse.Namespace, device: torch.device, reference: dict
) -> dict:
    """Time one (term, kernels) at args.chunk_size: warm-up (compiles), check against the eager reference, time."""
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        loss = run_loss(term, x, args, kernels)  # warm-up: compilation stays out of the timing
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        grad_diff = loss_diff = None
        if kernels is not None:
            grad = x["hidden"].grad.float()
            grad_diff = float((grad - reference["grad"]).norm() / reference["grad"].norm())
            loss_diff = abs(float(loss) - reference["loss"]) / abs(reference["loss"])
            del grad
        ms = time_ms(lambda: run_loss(term, x, args, kernels), device, args.repeats)
    except torch.OutOfMemoryError:
        return {"ms": None, "peak": None, "grad_diff": None, "loss_diff": None}
    return {"ms": ms, "peak": peak, "grad_diff": grad_diff, "loss_diff": loss_diff}


def eager_reference(term: str, x: dict, args: argparse.Namespace) -> dict:
    loss = run_loss(term, x, args, None)
    return {"loss": float(loss), "grad": x["hidden"].grad.float().clone()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chunks",
        default="4096,1728",
        help="comma-separated chunk sizes (rows); the first one is the one --profile uses",
    )
    parser.add_argument(
        "--kernels", help="comma list of eager, compiled, triton (default: cuda compiled,triton; cpu eager)"
    )
    parser.add_argument("--terms", default="ce,ce-kl", help=f"comma list of {', '.join(TERMS)}")
    parser.add_argument(
        "--triton-configs",
        help="comma list of BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM] for the triton "
        "CE kernel (default: $DFLASH_CE_TRITON or the library default)",
    )
    parser.add_argument(
        "--kl-triton-configs",
        help="the same for the triton CE+KL kernel (default: $DFLASH_KL_TRITON or the library default)",
    )
    parser.add_argument("--kl-weight", type=float, default=0.15, help="soft-label weight (the seed's 0.15)")
    parser.add_argument("--kl-temperature", type=float, default=2.0, help="soft-label temperature (the seed's 2.0)")
    parser.add_argument("--cap-lambda", type=float, default=0.1, help="CAP weight in the -cap terms")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="top kernels of one CE and one CE+KL fwd+bwd per kernel set, at the first chunk size",
    )
    args = parse_args(sys.argv[1:] if argv is None else argv, parser)
    args.kernels = args.kernels or ("compiled,triton" if args.device.startswith("cuda") else "eager")
    terms = args.terms.split(",")
    if any(t not in TERMS for t in terms):
        raise SystemExit(f"error: unknown term in {args.terms!r}: one of {', '.join(TERMS)}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    chunk_sizes = [int(c) for c in args.chunks.split(",")]
    sets = {term: kernel_sets(args, term) for term in terms}
    print(
        f"loss GEMM-equivalents: device={device} M={args.rows} H={args.hidden} V={args.vocab} "
        f"B={args.block_size} dtype={args.dtype} repeats={args.repeats} kl_weight={args.kl_weight} "
        f"T={args.kl_temperature} cap_lambda={args.cap_lambda} torch={torch.__version__}",
        file=sys.stderr,
    )
    x = make_inputs(args, device)  # once: every row runs on the same inputs
    # The unit: one logits GEMM over the rows the loss computes, blocks x (B - 1) (slot 0 is never computed since
    # bench/results/step.md 2026-12-02 "The last 8-15 ms of the 8B seed step"; before, the unit and the loss both covered all M rows, so GEMM-equivalents stay comparable).
    supervised = x["hidden"][: args.rows // args.block_size * (args.block_size - 1)]
    with torch.no_grad():
        gemm = lambda: supervised @ x["weight"].T  # noqa: E731
        gemm()
        gemm_ms = time_ms(gemm, device, max(args.repeats, 3))
    print(
        f"{'chunk':>6} {'kernels':<22} {'terms':<10} {'ms':>9} {'GEMM-eq':>8} {'peak GiB':>9} {'grad diff':>10} "
        f"{'loss diff':>10}",
        flush=True,
    )
    rows = []
    for chunk in chunk_sizes:
        args.chunk_size = chunk
        for term in terms:
            reference = eager_reference(term, x, args) if any(k is not None for _, k in sets[term]) else {}
            for label, kernels in sets[term]:
                row = {
                    "chunk": chunk,
                    "kernels": label,
                    "term": term,
                    **measure_row(term, kernels, x, args, device, reference),
                }
                rows.append(row)
                print(_row_text(row, gemm_ms), flush=True)
            reference.clear()
    print(f"one logits GEMM: {gemm_ms:.2f} ms")
    if args.profile:
        args.chunk_size = chunk_sizes[0]
        for term in (t for t in ("ce", "ce-kl") if t in terms):
            for label, kernels in sets[term]:
                profile(term, label, kernels, x, args, device, gemm_ms)
    summary(rows, gemm_ms)
    return 0


def summary(rows: list[dict], gemm_ms: float) -> None:
    """The best (fastest) row per (term, kernel kind), against the goal and the floor."""
    best: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["term"], row["kernels"].split("[")[0])
        if row["ms"] is not None and (key not in best or row["ms"] < best[key]["ms"]):
            best[key] = row
    print(f"\nsummary (best chunk/config per term and kernels; one logits GEMM {gemm_ms:.2f} ms):")
    print(f"  {'terms':<10} {'kernels':<22} {'chunk':>6} {'GEMM-eq':>8} {'floor':>6} {'goal':>5}  met")
    for (term, _), row in sorted(best.items(), key=lambda item: (TERMS.index(item[0][0]), item[0][1])):
        eq = row["ms"] / gemm_ms
        print(
            f"  {term:<10} {row['kernels']:<22} {row['chunk']:>6} {eq:>8.2f} {FLOORS[term]:>6} "
            f"{GOALS[term]:>5}  {'yes' if eq <= GOALS[term] else 'no'}"
        )


def profile(
    term: str,
    label: str,
    kernels: ChunkKernels | None,
    x: dict,
    args: argparse.Namespace,
    device: torch.device,
    gemm_ms: float,
    top: int = 8,
) -> None:
    """Top kernels by total device time over one forward+backward (after a warm-up that compiles)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    run_loss(term, x, args, kernels)  # warm-up: compilation stays out of the trace
    _sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_loss(term, x, args, kernels)
        _sync(device)

    def total_us(event) -> float:  # kernels: their device time; CPU fallback: self CPU time of the op
        if cuda:
            return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        return event.self_cpu_time_total

    events = sorted(prof.key_averages(), key=total_us, reverse=True)
    everything = sum(total_us(e) for e in events) / 1e3
    print(
        f"\nprofile {label} {term}, chunk {args.chunk_size}, one fwd+bwd: {everything:.1f} ms of "
        f"{'kernels' if cuda else 'CPU ops'} = {everything / gemm_ms:.2f} GEMM-eq"
    )
    print(f"  {'kernel':<70} {'count':>6} {'total ms':>9} {'GEMM-eq':>8}")
    for event in events[:top]:
        ms = total_us(event) / 1e3
        print(f"  {event.key[:70]:<70} {event.count:>6} {ms:>9.2f} {ms / gemm_ms:>8.3f}")


def _row_text(row: dict, gemm_ms: float) -> str:
    ms = f"{row['ms']:>9.1f}" if row["ms"] is not None else f"{'OOM':>9}"
    eq = f"{row['ms'] / gemm_ms:.2f}" if row["ms"] is not None else "-"
    peak = f"{row['peak'] / 2**30:.2f}" if row["peak"] is not None else "-"
    grad = f"{row['grad_diff']:.1e}" if row["grad_diff"] is not None else "-"
    loss = f"{row['loss_diff']:.1e}" if row["loss_diff"] is not None else "-"
    return f"{row['chunk']:>6} {row['kernels']:<22} {row['term']:<10} {ms} {eq:>8} {peak:>9} {grad:>10} {loss:>10}"


if __name__ == "__main__":
    sys.exit(main())
