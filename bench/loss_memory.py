"""Peak memory and time of the chunked DFlash loss against a dense (materialised logits) loss.

    .venv/bin/python bench/loss_memory.py                      # CPU, moderate shape, 1 thread
    python bench/loss_memory.py --device cuda --compiled       # H200: 27B-style shape (M=32768, H=5120, V=248320)

Time is reported in GEMM-equivalents: (loss forward + backward) / one [M, H] x [H, V] logits GEMM in the
same dtype (docs/method.md#loss; goals: CE only <= 2.2, with soft KL <= 3.5). Peak memory is the extra memory above
the inputs: on CUDA from the caching allocator's peak statistics; on CPU each variant runs in a fresh
subprocess and reports peak RSS (ru_maxrss) minus the RSS after its inputs exist (tracemalloc cannot see
torch's allocations; for compiled variants on CPU it includes the compiler's own memory). The dense variants materialise [M, V] logits on purpose; on CUDA at the default
shape they may not fit, which the table shows as OOM. Before timing, the chunked loss is checked against
the dense one (and the compiled kernels against eager) on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.training.loss import dflash_loss, make_chunk_kernels, position_weights

DENSE = ("dense-ce", "dense-ce-kl")
CHUNKED = ("chunked-ce", "chunked-ce-kl", "chunked-ce-kl-cap")
COMPILED = ("compiled-ce", "compiled-ce-kl", "compiled-ce-kl-cap")


def uses_kernels(name: str) -> bool:
    """Variants that run the caller's chunk kernels ("compiled-ce", "triton-ce-cap", ...): every chunked
    variant whose prefix is not "chunked" (the eager kernels, the reference for their gradient)."""
    return name != "gemm" and name not in DENSE and not name.startswith("chunked-")


def eager_twin(name: str) -> str:
    return "chunked-" + name.split("-", 1)[1]


def make_inputs(args: argparse.Namespace, device: torch.device) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = args.rows // args.block_size * args.block_size
    hidden = torch.randn(rows, args.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5).to(device, dtype)
    teacher = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    labels = torch.randint(0, args.vocab, (rows,), generator=gen).to(device)
    weights = position_weights(args.block_size, 7.0).repeat(rows // args.block_size)
    weights[torch.rand(rows, generator=gen) < 0.1] = 0.0
    return dict(
        hidden=hidden,
        weight=weight,
        teacher=teacher,
        labels=labels,
        weights=weights.to(device),
        normalizer=float(weights.sum()),
        blocks=float(rows // args.block_size),
    )


def dense_loss(x: dict, use_kl: bool, temperature: float = 1.0) -> torch.Tensor:
    """What a straightforward trainer does: fp32 logits, log_softmax, autograd keeps them for backward."""
    logits = (x["hidden"] @ x["weight"].T).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    ce = -log_probs.gather(1, x["labels"][:, None]).squeeze(1)
    loss = (x["weights"] * ce).sum() / x["normalizer"]
    if use_kl:
        with torch.no_grad():
            teacher = torch.log_softmax((x["teacher"] @ x["weight"].T).float() / temperature, dim=-1)
        kl = torch.nn.functional.kl_div(
            torch.log_softmax(logits / temperature, dim=-1), teacher, log_target=True, reduction="none"
        ).sum(-1)
        loss = loss + temperature**2 * (x["weights"] * kl).sum() / x["normalizer"]
    return loss


def run_variant(name: str, x: dict, args: argparse.Namespace, kernels) -> torch.Tensor:
    """One forward + backward of a variant (or the reference GEMM); returns the loss (or GEMM output)."""
    x["hidden"].grad = None
    if name == "gemm":
        with torch.no_grad():
            return x["hidden"] @ x["weight"].T
    if name in DENSE:
        loss = dense_loss(x, use_kl=name.endswith("kl"))
    else:
        use_kl, use_cap = "-kl" in name, name.endswith("cap")
        loss = dflash_loss(
            x["hidden"],
            x["weight"],
            x["labels"],
            x["weights"],
            block_size=args.block_size,
            normalizer=x["normalizer"],
            teacher_hidden=x["teacher"] if use_kl else None,
            kl_weight=1.0 if use_kl else 0.0,
            cap_lambda=0.1 if use_cap else 0.0,
            num_blocks_normalizer=x["blocks"],
            chunk_size=args.chunk_size,
            kernels=kernels if uses_kernels(name) else None,
        ).loss
    loss.backward()
    return loss.detach()


def measure(name: str, args: argparse.Namespace, device: torch.device, kernels=None) -> dict:
    """Median time (ms) over repeats after one warm-up, and the peak extra memory (bytes) of the variant."""
    x = make_inputs(args, device)
    cuda = device.type == "cuda"
    base_rss = _current_rss()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    try:
        value = run_variant(name, x, args, kernels)  # warm-up (and compilation)
        grad_diff = None
        if uses_kernels(name):  # compiled/triton kernels must give the eager gradient (relative L2 difference)
            compiled_grad = x["hidden"].grad.float().clone()
            run_variant(eager_twin(name), x, args, None)
            eager_grad = x["hidden"].grad.float()
            grad_diff = float((compiled_grad - eager_grad).norm() / eager_grad.norm())
            del compiled_grad, eager_grad
        times = []
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            run_variant(name, x, args, kernels)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    except torch.OutOfMemoryError:
        return {"variant": name, "ms": None, "peak_bytes": None, "value": None}
    peak = torch.cuda.max_memory_allocated() - base if cuda else _peak_rss() - base_rss
    scalar = float(value) if value.dim() == 0 else None
    return {
        "variant": name,
        "ms": statistics.median(times),
        "peak_bytes": peak,
        "value": scalar,
        "grad_diff_vs_eager": grad_diff,
    }


def _current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_in_child(name: str, argv: list[str]) -> dict:
    """CPU: a fresh process per variant, so ru_maxrss is that variant's peak and nothing else's."""
    out = subprocess.run([sys.executable, __file__, *argv, "--child", name], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The shape/device flags shared by the loss benches (a caller may pass a parser with extra flags)."""
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, help="block tokens M (default: cpu 2048, cuda 32768)")
    parser.add_argument("--hidden", type=int, help="H (default: cpu 256, cuda 5120)")
    parser.add_argument("--vocab", type=int, help="V (default: cpu 32768, cuda 248320)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, help="rows per chunk (default: cpu 256, cuda the library's ~1 GiB)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="default: cpu fp32, cuda bf16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--compiled", action="store_true", help="also time torch.compile'd chunk kernels")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense variants")
    parser.add_argument("--json", action="store_true", help="print rows as JSON lines instead of a table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.rows = args.rows or (32768 if gpu else 2048)
    args.hidden = args.hidden or (5120 if gpu else 256)
    args.vocab = args.vocab or (248320 if gpu else 32768)
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.chunk_size = args.chunk_size or (None if gpu else 256)  # cpu: 8 chunks, else one chunk holds all rows
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.child:  # CPU worker: one variant, one JSON line
        kernels = make_chunk_kernels("compiled" if args.child in COMPILED else "eager")
        print(json.dumps(measure(args.child, args, device, kernels)))
        return 0
    names = ["gemm", *([] if args.no_dense else DENSE), *CHUNKED, *(COMPILED if args.compiled else ())]
    print(
        f"loss bench: device={device} M={args.rows} H={args.hidden} V={args.vocab} B={args.block_size} "
        f"dtype={args.dtype} chunk={args.chunk_size or 'auto'} repeats={args.repeats}",
        file=sys.stderr,
    )
    kernels = make_chunk_kernels("compiled") if args.compiled and device.type == "cuda" else None
    rows = []
    for name in names:
        print(f"  running {name} ...", file=sys.stderr)
        row = measure(name, args, device, kernels) if device.type == "cuda" else measure_in_child(name, argv)
        rows.append(row)
    report(rows, args)
    return 0


def report(rows: list[dict], args: argparse.Namespace) -> None:
    gemm_ms = rows[0]["ms"]
    by_name = {row["variant"]: row for row in rows}
    for row in rows:
        row["gemm_equivalents"] = row["ms"] / gemm_ms if row["ms"] and gemm_ms else None
        partner = by_name.get(
            row["variant"].replace("chunked", "dense").replace("compiled", "dense").replace("-cap", "")
        )
        if (
            row["value"] is not None
            and partner
            and partner["value"] is not None
            and partner is not row
            and not row["variant"].endswith("cap")
        ):
            row["rel_diff_vs_dense"] = abs(row["value"] - partner["value"]) / abs(partner["value"])
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        f"{'variant':<20} {'ms':>10} {'GEMM-eq':>8} {'peak MiB':>10} {'loss rel diff vs dense':>23} "
        f"{'grad rel diff vs eager':>23}"
    )
    for row in rows:
        ms = f"{row['ms']:.1f}" if row["ms"] is not None else "OOM"
        eq = f"{row['gemm_equivalents']:.2f}" if row.get("gemm_equivalents") else "-"
        peak = f"{row['peak_bytes'] / 2**20:.0f}" if row["peak_bytes"] is not None else "OOM"
        diff = f"{row['rel_diff_vs_dense']:.1e}" if "rel_diff_vs_dense" in row else "-"
        grad = f"{row['grad_diff_vs_eager']:.1e}" if row.get("grad_diff_vs_eager") is not None else "-"
        print(f"{row['variant']:<20} {ms:>10} {eq:>8} {peak:>10} {diff:>23} {grad:>23}")
    print("goals (docs/method.md#loss, issue 7): chunked/compiled CE <= 2.2 GEMM-eq, with KL <= 3.5")


if __name__ == "__main__":
    sys.exit(main())
