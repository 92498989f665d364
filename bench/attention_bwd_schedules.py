"""Issue 31 item 2 (bench/results/kernels.md 2026-12-04 and 2026-12-05): backward schedules of our interval attention against flex on the H200.

    python3 bench/attention_bwd_schedules.py --json-out OUT.json --best-out BEST.txt

Shapes: qwen3-8b seed (6 x 8192 context, 171 anchors x 32) and specforge (2 x 768, 256 x 16), 32 q / 8 kv heads x
128, bf16, sorted anchors (bench/attention_vs_flex.py's inputs). Each schedule of VARIANTS (trainer/model/
attention_triton.py BwdConfig) is compiled first in parallel worker processes (one Triton cache: the main process
then finds them built), reports its registers, spills and shared memory, is checked against flex's gradients at
both shapes (outputs NaN-poisoned first: the caching allocator would otherwise hand a schedule the previous one's
correct dK/dV) and against an fp32 dense reference at the specforge shape, then timed: flex fwd, flex fwd+bwd, our fwd, every schedule's bwd, in rounds (the
GPU drifts), CUDA events, median of 10. The "none" schedules skip dQ: timing diagnostics (their dq is not checked).
--best-out: the fastest schedule at the seed shape with dQ, as $DFLASH_ATTENTION_BWD_CONFIG text, written only
when our fwd + that bwd beat flex's fwd + bwd there (the gate for the step bench).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_vs_flex import dense_reference, inputs, masks, rel, run

from trainer.bench.bench_common import time_ms as bench_time_ms
from trainer.kernels import attention_triton as T
from trainer.kernels import triton_fit
from trainer.model import attention as A

C = T.BwdConfig
VARIANTS = {
    "none": C(128, 64, 8, 2, "none"),  # dK, dV only: the 4-matmul floor of this schedule
    "atomic": C(128, 64, 8, 2, "atomic"),
    "tma": C(128, 64, 8, 2, "tma"),  # the ladder's first rung (2026-12-04)
    "tma-s1": C(128, 64, 8, 1, "tma"),  # its second: ~96 KB of shared memory
    "tma-s3": C(128, 64, 8, 3, "tma"),
    "tma-m32": C(128, 32, 8, 2, "tma"),
    "tma-m32-s3": C(128, 32, 8, 3, "tma"),
    "tma-n64-w8": C(64, 64, 8, 2, "tma"),
    "atomic-n64s1": C(64, 64, 4, 1, "atomic"),  # the ladder's last rungs
    "atomic-n32s1": C(32, 64, 4, 1, "atomic"),
    # 2026-12-05: dQ transposed ("t": dQ^T = K^T dS^T, both operands from shared memory), the softmax scale
    # folded into P ("f"), the matmuls reordered ("o"); BwdConfig says what each changes
    "tma-f": C(128, 64, 8, 2, "tma", "f"),
    "tma-t": C(128, 64, 8, 2, "tma", "t"),
    "tma-tf": C(128, 64, 8, 2, "tma", "tf"),
    "tma-tf-s3": C(128, 64, 8, 3, "tma", "tf"),
    "tma-tf-s1": C(128, 64, 8, 1, "tma", "tf"),
    "atomic-tf": C(128, 64, 8, 2, "atomic", "tf"),
    "tma-o": C(128, 64, 8, 2, "tma", "o"),
    "tma-tfo": C(128, 64, 8, 2, "tma", "tfo"),
    # 2026-12-05, later: `o` on other tiles: the one- and three-stage forms of rung 0, and the ~99 KB candidates for the
    # ladder's second rung (90,112 and 81,920 B compiled here with Triton 3.9; the 2026-12-05 rung 1 is 98,304 B)
    "tma-tfo-s3": C(128, 64, 8, 3, "tma", "tfo"),
    "tma-tfo-s1": C(128, 64, 8, 1, "tma", "tfo"),
    "tma-m32-tfo": C(128, 32, 8, 2, "tma", "tfo"),
    "tma-m32-tfo-s1": C(128, 32, 8, 1, "tma", "tfo"),
    "tma-n64-o-s1": C(64, 64, 8, 1, "tma", "o"),
    "tma-n64-w4-tfo": C(64, 64, 4, 2, "tma", "tfo"),
}
# the 2026-12-04 forward (every key tile masked), timed beside the default (since 2026-12-05: full tiles unmasked)
FWD_MASKED = T.FwdConfig(128, 128, 8, 2, False)
SHAPE_NAMES = ("seed", "specforge")
# bf16 against flex (2026-12-03: 1.2e-3 to 1.8e-3) and against fp32 dense (2.1e-3 to 2.4e-3, flex's own): a wrong
# index or a lost tile is O(1)
PARITY_TOL = 1e-2


def spec(c: T.BwdConfig) -> str:
    return f"{c.block_n},{c.block_m},{c.num_warps},{c.num_stages},{c.dq}" + (f",{c.flags}" if c.flags else "")


def time_ms(fn) -> float:
    return statistics.median(bench_time_ms(fn, torch.device("cuda"), warmup=2, iters=10))


class Problem:
    """One shape's inputs, masks, flex's reference gradients and our forward's (o, lse)."""

    def __init__(self, name: str, with_flex: bool = True) -> None:
        self.name = name
        self.batch, self.shape, self.q, self.k, self.v, self.go = inputs(name)
        self.flex, tri = masks(self.batch, self.shape)
        self.table = tri.triton[A.FULL]
        self.scale = self.q.shape[-1] ** -0.5
        self.o, self.lse = self.forward()
        if with_flex:
            _, self.flex_grads = run(self.q, self.k, self.v, self.go, self.flex, True)

    def forward(self, config: T.FwdConfig | None = None):
        t = self.table
        return T.forward(self.q, self.k, self.v, t.ctx_lo, t.ctx_hi, t.blk_lo, t.blk_hi, self.scale, config=config)

    def backward(self, c: T.BwdConfig):
        return T.backward(self.go, self.q, self.k, self.v, self.o, self.lse, self.table, self.scale, config=c)

    def compile_stats(self, c: T.BwdConfig) -> dict:
        """Registers, spills, shared memory of `c`'s compiled kernel (compiles it: the Triton cache keeps it)."""
        _, _, bwd = T._kernels()
        R, H, n_q, D = self.q.shape
        delta = torch.zeros(R, H, n_q, device="cuda")
        # dtypes as backward allocates them: the kernel's signature (and so its cache entry) includes them
        dk = torch.empty(self.k.shape, dtype=self.k.dtype, device="cuda")
        dv = torch.empty(self.v.shape, dtype=self.v.dtype, device="cuda")
        e = T.effective(c, self.q.device)
        dq = T.dq_buffer(e, self.q)
        grid, args, kwargs = T._bwd_launch(
            e, self.q, self.k, self.v, self.go, self.lse, delta, dq, dk, dv, self.table, 1.0
        )
        t0 = time.perf_counter()
        kernel = bwd.warmup(*args, grid=grid, **kwargs)
        seconds = time.perf_counter() - t0
        try:
            kernel._init_handles()
        except Exception:  # noqa: BLE001 - the counts are a diagnostic
            pass
        return {
            "regs": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None),
            "shared": int(kernel.metadata.shared),
            "compile_s": round(seconds, 1),
        }


_PROBLEMS: dict[str, Problem] = {}


def _precompile(task: tuple[str, str]) -> tuple[str, str, dict | str]:
    """Worker: compile one (shape, variant) into the shared Triton cache; its stats or the error's text."""
    shape, name = task
    try:
        if shape not in _PROBLEMS:
            _PROBLEMS[shape] = Problem(shape, with_flex=False)
        return shape, name, _PROBLEMS[shape].compile_stats(VARIANTS[name])
    except Exception as exc:  # noqa: BLE001 - reported in the table; the main process retries serially
        return shape, name, f"{type(exc).__name__}: {str(exc)[:300]}"


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty hands out NaN-filled memory while the parity checks run."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    with mock.patch.object(torch, "empty", empty):
        yield


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out", default="")
    ap.add_argument("--best-out", default="")
    ap.add_argument(
        "--split-out", default="", help="write 1 when the (default) split forward beats the masked one at seed, else 0"
    )
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="", help="comma-separated names of VARIANTS (default: all)")
    args = ap.parse_args()
    if args.variants:
        keep = args.variants.split(",")
        unknown = [n for n in keep if n not in VARIANTS]
        if unknown:
            raise SystemExit(f"error: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        for name in list(VARIANTS):
            if name not in keep:
                del VARIANTS[name]
    import triton

    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    # Our schedules compile in worker processes while this one builds the problems and compiles flex.
    tasks = [(shape, name) for name in VARIANTS for shape in SHAPE_NAMES]
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=max(1, args.workers), mp_context=get_context("spawn"))
    futures = [pool.submit(_precompile, task) for task in tasks] if args.workers > 0 else []
    problems = {name: Problem(name) for name in SHAPE_NAMES}
    torch.cuda.synchronize()
    print(f"problems and flex ready in {time.perf_counter() - t0:.1f} s", flush=True)
    stats: dict = {}
    for future in futures:
        shape, name, got = future.result()
        stats[(shape, name)] = got
    pool.shutdown()
    print(f"precompiled {len(futures)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)
    limit = triton_fit.smem_limit(torch.device("cuda")) or 1 << 30
    results: dict = {"variants": {n: spec(c) for n, c in VARIANTS.items()}, "shapes": {}}
    for shape_name in SHAPE_NAMES:
        t0 = time.perf_counter()
        p = problems[shape_name]
        out: dict = {"parity": {}, "stats": {}, "ms": {}}
        for name, c in VARIANTS.items():
            got = stats.get((shape_name, name))
            if not isinstance(got, dict):
                try:
                    got = p.compile_stats(c)
                except Exception as exc:  # noqa: BLE001 - a schedule that does not compile is a result
                    got = f"{type(exc).__name__}: {str(exc)[:300]}"
            if isinstance(got, dict) and got["shared"] > limit:
                got = f"does not fit: {got}"
            out["stats"][name] = got
            if not isinstance(got, dict):
                print(f"{shape_name} {name}: {got}", flush=True)
                continue
            try:
                with poisoned_empty():
                    grads = p.backward(c)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a schedule that does not launch is a result
                out["stats"][name] = f"launch: {type(exc).__name__}: {str(exc)[:300]}"
                print(f"{shape_name} {name}: {out['stats'][name]}", flush=True)
                continue
            errs = {g: rel(a, b) for g, a, b in zip(("dq", "dk", "dv"), grads, p.flex_grads)}
            if c.dq == "none":
                errs.pop("dq")
            out["parity"][name] = {"vs_flex": errs}
        if shape_name == "specforge":
            od, gd = dense_reference(p.q, p.k, p.v, p.go, p.batch, p.shape)
            out["flex_vs_dense"] = {g: rel(a, b) for g, a, b in zip(("dq", "dk", "dv"), p.flex_grads, gd)}
            out["fwd_vs_dense"] = rel(p.o, od)
            for name, c in VARIANTS.items():
                if name in out["parity"]:
                    with poisoned_empty():
                        grads = p.backward(c)
                    errs = {g: rel(a, b) for g, a, b in zip(("dq", "dk", "dv"), grads, gd)}
                    if c.dq == "none":
                        errs.pop("dq")
                    out["parity"][name]["vs_dense"] = errs
            del od, gd
        with poisoned_empty():
            o_masked, lse_masked = p.forward(FWD_MASKED)
        out["fwd_masked_vs_fwd"] = {"o": rel(o_masked, p.o), "lse": float((lse_masked - p.lse).abs().max())}
        print(f"{shape_name}: masked forward vs the default {out['fwd_masked_vs_fwd']}", flush=True)
        print(f"{shape_name}: set up + parity in {time.perf_counter() - t0:.1f} s", flush=True)
        for name, par in out["parity"].items():
            print(f"{shape_name} {name:<16} {out['stats'][name]} {json.dumps(par)}", flush=True)
        runnable = [n for n in VARIANTS if n in out["parity"]]
        for _round in range(args.rounds):
            ms = out["ms"]
            ms.setdefault("flex fwd", []).append(time_ms(lambda p=p: run(p.q, p.k, p.v, p.go, p.flex, False)))
            both = time_ms(lambda p=p: run(p.q, p.k, p.v, p.go, p.flex, True))
            ms.setdefault("flex bwd", []).append(both - ms["flex fwd"][-1])
            ms.setdefault("ours fwd", []).append(time_ms(p.forward))
            ms.setdefault("ours fwd masked", []).append(time_ms(lambda p=p: p.forward(FWD_MASKED)))
            for name in runnable:
                ms.setdefault(name, []).append(time_ms(lambda p=p, c=VARIANTS[name]: p.backward(c)))
        results["shapes"][shape_name] = out

    print(
        f"\n{'variant':<16} {'spec':<22} {'regs':>4} {'spill':>5} {'smem':>7} | seed ms (x fwd) | specforge ms | parity"
    )
    seed, sf = results["shapes"]["seed"], results["shapes"]["specforge"]
    for label in ("flex fwd", "flex bwd", "ours fwd", "ours fwd masked"):
        print(f"{label:<16} {'':<22} {'':>4} {'':>5} {'':>7} | {fmt(seed['ms'][label])} | {fmt(sf['ms'][label])}")
    best, best_ms = None, float("inf")
    for name, c in VARIANTS.items():
        st = seed["stats"].get(name)
        if not isinstance(st, dict) or name not in seed["ms"]:
            print(f"{name:<16} {spec(c):<22} failed")
            continue
        med = statistics.median(seed["ms"][name])
        errs = [
            *seed["parity"][name]["vs_flex"].values(),
            *sf["parity"].get(name, {}).get("vs_dense", {"-": 1}).values(),
        ]
        correct = max(errs) < PARITY_TOL
        ratio = med / statistics.median(seed["ms"]["ours fwd"])
        print(
            f"{name:<16} {spec(c):<22} {st['regs']!s:>4} {st['spills']!s:>5} {st['shared']:>7} | "
            f"{fmt(seed['ms'][name])} ({ratio:.2f}x) | {fmt(sf['ms'].get(name, []))} | max err {max(errs):.1e}"
        )
        if c.dq != "none" and correct and med < best_ms:
            best, best_ms = name, med
    flex_total = statistics.median(seed["ms"]["flex fwd"]) + statistics.median(seed["ms"]["flex bwd"])
    ours_total = statistics.median(seed["ms"]["ours fwd"]) + best_ms
    gate = best is not None and ours_total < flex_total
    masked_fwd = statistics.median(seed["ms"]["ours fwd masked"])
    print(f"best {best} ({best_ms:.2f} ms); seed fwd+bwd ours {ours_total:.2f} vs flex {flex_total:.2f}: gate {gate}")
    print(
        f"with the masked forward: fwd {masked_fwd:.2f} ms, bwd/fwd {best_ms / masked_fwd:.2f}x, "
        f"fwd+bwd {masked_fwd + best_ms:.2f}"
    )
    results["best"] = best
    results["gate"] = gate
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=str))
    split_ok = all(v < PARITY_TOL for r in results["shapes"].values() for v in r["fwd_masked_vs_fwd"].values())
    split_wins = split_ok and statistics.median(seed["ms"]["ours fwd"]) < masked_fwd
    print(
        f"default (split) forward: parity {'ok' if split_ok else 'FAILED'}, {'faster' if split_wins else 'not faster'}"
    )
    if args.split_out:
        Path(args.split_out).write_text("1\n" if split_wins else "0\n")
    if args.best_out:
        Path(args.best_out).write_text(spec(VARIANTS[best]) + "\n" if gate and best else "")


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:6.2f}" for v in values) if values else "-"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
