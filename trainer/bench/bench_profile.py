"""Where a drafter step's time goes: `python -m trainer bench step ... --profile` (issue 19, item 2).

torch.profiler records the CUDA kernels of a few steps (after warm-up, so no compile is in them); each
kernel is put in one category by its name, and the step's wall time that no kernel covers is reported as
`gaps` (launch latency, host work, syncs between kernels). The categories are the places the MFU goal can
be won: the matmuls of the layers and the LM head, attention (flex_attention's forward and backward
templates), the loss's element-wise kernels (the fused Triton CE kernel or the compiled stats/grad pair),
the other element-wise and reduction work Inductor generates (norms, RoPE, SwiGLU, residuals, casts), the
optimizer, copies. Kernel names are matched, not guessed from the model: the table also lists the ten
largest kernels of each category, so a miscategorised one is visible.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import torch

# First match wins; the order puts the specific names before the broad ones.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("loss kernels", re.compile(r"_ce_rows_kernel|_ce_kl|ce_kl|_student_stats|_logit_grad|logsumexp", re.I)),
    ("attention", re.compile(r"flex_attention|flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach|_fused_adamw", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|_mm_|splitk|sm90_", re.I)),
    ("element-wise, reductions", re.compile(r"triton_(poi|red|per)_|elementwise|reduce|vectorized|unrolled", re.I)),
    ("copies, fills", re.compile(r"memcpy|memset|copy|fill|cat_|Memcpy|Memset", re.I)),
)


TOP_KERNELS = 10  # largest kernels listed per category


def category_of(kernel: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel):
            return name
    return "other"


def _device_time_us(event: object) -> float:
    # torch 2.11 names it self_device_time_total; older releases self_cuda_time_total.
    for attribute in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attribute, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_steps(step: Callable[[], None], device: torch.device, steps: int = 3) -> dict:
    """Run `step` `steps` times under the profiler; per-step milliseconds by category, the gap, and the top
    kernels. CUDA only (returns {} elsewhere)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize(device)
    wall_ms = start.elapsed_time(end) / steps
    by_category: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith("CUDA") and _device_time_us(event) > 0:
            ms = _device_time_us(event) / 1000 / steps
            category = category_of(event.key)
            by_category[category] += ms
            kernels[category].append((ms, event.key))
    busy = sum(by_category.values())
    return {
        "wall_ms": wall_ms,
        "busy_ms": busy,
        "gap_ms": max(0.0, wall_ms - busy),
        "categories": dict(by_category),
        "top": {name: sorted(entries, reverse=True)[:TOP_KERNELS] for name, entries in kernels.items()},
    }


def print_profile(label: str, result: dict, flops: float) -> None:
    """The breakdown as a table (ms per step, share of the step, and for matmuls their achieved TFLOP/s)."""
    if not result:
        return
    wall = result["wall_ms"]
    print(
        f"profile {label}: {wall:.1f} ms per step under the profiler, kernels busy {result['busy_ms']:.1f} ms, "
        f"{flops / (wall * 1e-3) / 1e12:.0f} TFLOP/s overall"
    )
    print(f"  {'where':<26} {'ms/step':>8} {'share':>7}")
    for name, ms in sorted(result["categories"].items(), key=lambda item: -item[1]):
        print(f"  {name:<26} {ms:8.2f} {ms / wall:7.1%}")
    print(f"  {'gaps (no kernel running)':<26} {result['gap_ms']:8.2f} {result['gap_ms'] / wall:7.1%}")
    for name, entries in result["top"].items():
        for ms, kernel in entries:
            print(f"    [{name}] {ms:7.2f} ms  {kernel[:110]}")
