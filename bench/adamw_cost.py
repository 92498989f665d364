"""Issue 31 item 3 (bench/results/pipeline.md 2026-12-04): the optimizer step of the qwen3-8b drafter alone, torch's fused AdamW against
trainer/kernels/adamw_triton.py's kernel, on the H200.

    python3 bench/adamw_cost.py [--iters 10] [--configs 4096:8,2048:4,8192:8]

The drafter's 58 trainable fp32 tensors (1.05 B parameters, random values, gradients and moments), the clip as
the step runs it (get_total_norm, then the coefficient as grad_scale). Parity: one step of each from the same
state, max relative difference of the parameters and both moments. Timing (CUDA events, median of --iters, the
variants interleaved): the norm alone, fused AdamW with grad_scale (it also writes the gradients back: 32 B/param),
TritonAdamW at each (BLOCK, warps) config (28 B/param), and the achieved bandwidth of each. Table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import time_ms
from trainer.kernels import adamw_triton
from trainer.kernels.adamw_triton import TritonAdamW
from trainer.model import DFlashDrafter
from trainer.model.drafter import DrafterConfig


def drafter_tensors(device: torch.device, small: bool) -> list[torch.Tensor]:
    hidden = 64 if small else 4096  # --small: this script's CPU smoke run (TRITON_INTERPRET=1)
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=5,
        num_attention_heads=4 if small else 32,
        num_key_value_heads=2 if small else 8,
        head_dim=16 if small else 128,
        vocab_size=151936,
        block_size=16,
        target_layer_ids=[1, 9, 17, 25, 33],
        num_target_layers=36,
        mask_token_id=151669,
    )
    with torch.device("meta"):
        shapes = [p.shape for p in DFlashDrafter(cfg).parameters()]
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(s, device=device, generator=g) * 0.02 for s in shapes]


def make(kind: str, base: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    params = [p.clone() for p in base]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt: torch.optim.AdamW = (
        TritonAdamW(params, lr=6e-4, weight_decay=0.01)
        if kind == "triton"
        else torch.optim.AdamW(params, lr=6e-4, weight_decay=0.01, fused=True)
    )
    return params, opt


def clip_and_step(params: list[torch.Tensor], opt: torch.optim.AdamW) -> None:
    """What DrafterSide.optimizer_step does on CUDA, less the scheduler and zero_grad (the grads stay)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    opt.grad_scale = ((norm + 1e-6) / 1.0).clamp(min=1.0)  # type: ignore[attr-defined]
    opt.step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--configs", default="4096:8,2048:4,8192:8,1024:4")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 64-wide drafter (CPU smoke run under the interpreter)")
    args = parser.parse_args()
    device = torch.device(args.device)
    base = drafter_tensors(device, args.small)
    n = sum(p.numel() for p in base)
    g = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, device=device, generator=g) * 1e-3 for p in base]
    print(f"{len(base)} tensors, {n / 1e9:.3f} B parameters")

    # parity: one step each from the same state (grads large enough that the clip acts: scale > 1)
    fused_p, fused_opt = make("fused", base, grads)
    triton_p, triton_opt = make("triton", base, grads)
    clip_and_step(fused_p, fused_opt)  # type: ignore[arg-type]
    clip_and_step(triton_p, triton_opt)  # type: ignore[arg-type]
    # |difference| / max(|value|, floor): the floor is the update's size for parameters (lr: where p - update
    # cancels to ~0 a plain relative error measures the cancellation, not the kernel) and 1e-3 of the tensor's
    # largest value for the moments
    worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for a, b in zip(fused_p, triton_p):
        worst["param"] = max(worst["param"], float(((a - b).abs() / b.abs().clamp(min=6e-4)).max()))
        sa, sb = fused_opt.state[a], triton_opt.state[b]  # type: ignore[attr-defined]
        for key in ("exp_avg", "exp_avg_sq"):
            floor = float(sb[key].abs().max()) * 1e-3
            worst[key] = max(worst[key], float(((sa[key] - sb[key]).abs() / sb[key].abs().clamp(min=floor)).max()))
    print(
        "parity, max relative difference fused vs triton after one step: "
        + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    )
    del fused_p, fused_opt, triton_p, triton_opt
    if device.type == "cuda":
        torch.cuda.empty_cache()

    fused_p, fused_opt = make("fused", base, grads)
    triton_p, triton_opt = make("triton", base, grads)
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]

    def triton_at(block: int, warps: int):
        def run() -> None:
            adamw_triton.BLOCK, adamw_triton.NUM_WARPS = block, warps
            clip_and_step(triton_p, triton_opt)  # type: ignore[arg-type]

        return run

    variants = {
        "norm only": lambda: torch.nn.utils.get_total_norm([p.grad for p in fused_p]),
        "fused (norm + step)": lambda: clip_and_step(fused_p, fused_opt),  # type: ignore[arg-type]
        **{f"triton {b}:{w} (norm + step)": triton_at(b, w) for b, w in configs},
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):  # interleaved rounds against the GPU's drift
        for name, fn in variants.items():
            times[name] += time_ms(fn, device, warmup=2, iters=args.iters)
    norm_ms = statistics.median(times["norm only"])
    print(f"{'variant':<28} {'ms':>7} {'step ms':>8} {'step TB/s':>9}")
    for name, values in times.items():
        ms = statistics.median(values)
        step_ms = ms - norm_ms if name != "norm only" else ms
        moved = n * (4 if name == "norm only" else 32 if name.startswith("fused") else 28)
        print(f"{name:<28} {ms:7.2f} {step_ms:8.2f} {moved / (step_ms * 1e-3) / 1e12:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
