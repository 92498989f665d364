"""`python -m trainer bench step|loss|attention|pipeline`: throughput on synthetic batches.

    python -m trainer bench step --preset qwen3-8b --shape seed,recipe --variants compiled,eager,unsorted
    python -m trainer bench loss --preset qwen3-8b
    python -m trainer bench attention --preset qwen3-8b --shape seed
    python -m trainer bench pipeline --preset qwen3-8b --shape recipe     # target prefill + drafter step, one GPU

Every number comes from this process on this device: the matmul ceiling is measured first (an 8192^3 bf16
GEMM), each variant is warmed up (compiles happen there), then timed with CUDA events, median of `--iters`.
FLOPs are counted from the shapes (`step_flops`): 6 x params x tokens for the linear layers, 3 x the forward
for attention over the pairs the mask makes visible, and the LM head as docs/method.md#flops-and-throughput
counts it (2HV forward + 2HV input gradient per supervised block token, slots 1..B-1; +2HV for the teacher with
soft labels). MFU is reported against the card's datasheet peak (989 TFLOP/s on an H100 SXM or H200;
`bench_common.DATASHEET_PEAK_TFLOPS`, blank for a card it does not list) and against the measured ceiling. A
recompile after warm-up is reported in the `recompiles` column (it must be 0). On CPU the command runs too (tiny
shapes only make sense there).
The last thing printed is the table (stdout); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.bench.bench_common import (
    SHAPES,
    Shape,
    back_to_back_ms,
    checkpointed_loss,
    datasheet_peak_tflops,
    log,
    matmul_ceiling_tflops,
    preset_config,
    recompile_count,
    step_flops,
    synthetic_batch,
    time_ms,
)
from trainer.core.compile_scope import private_compile
from trainer.core.config import PRESETS, TrainerInputError
from trainer.data.batches import Batch
from trainer.model import DFlashDrafter, DrafterConfig, attention
from trainer.model.dflash2 import BlockConv
from trainer.model.drafter import finish_hidden
from trainer.training import loss as loss_module
from trainer.training.loss import ChunkKernels, dflash_loss, make_chunk_kernels, position_weights
from trainer.training.step import DrafterSide, FeatureBatch, TargetSide

VARIANTS = {
    "compiled": "layers + loss kernels torch.compile'd per device, sorted anchors, CE only",
    "eager": "no torch.compile on the layers or loss kernels (flex_attention itself stays compiled)",
    "unsorted": "compiled, anchors in random order (same loss, fragmented mask tiles)",
    "soft": "compiled, soft labels on (teacher logits recomputed from the target's final hidden)",
    "cap": "compiled, CAP term on (cap_lambda 0.1)",
    "triton": "compiled layers, loss through the fused Triton CE kernel (--loss-kernels triton; CUDA only)",
    "triton-foreach": "as triton, with the foreach AdamW (--adamw foreach; the default before 2026-12-01)",
    "triton-adamw": "as triton, AdamW through trainer/kernels/adamw_triton.py (--adamw triton: 28 B/param, no gradient "
    "write-back)",
    "soft-triton": "soft labels on, loss through the fused Triton CE+KL kernel (trainer/kernels/loss_triton_kl.py)",
    "ckpt-loss": "compiled layers, loss = per-chunk torch.utils.checkpoint of logits+CE (the 3-4 GEMM baseline)",
    "act-ckpt": "compiled, activation checkpointing of every drafter layer (memory for time)",
    "triton-s7": "as triton, as measured on 2026-12-02 before the 56% MFU work: predicate-form BlockMask not padded, context fc+norm (fp32) and "
    "final norm eager",
    "triton-tma": "as triton, flex_attention with kernel_options USE_TMA=True (Hopper's bulk tensor copies)",
    "triton-nopad": "as triton, q/k/v not padded to 128-row multiples (flex without IS_DIVISIBLE)",
    "triton-ctx32": "as triton, the context kept in fp32 after its norm (bench/results/step.md 2026-12-02 'The 8B seed step toward 56% MFU', run 1)",
    "triton-noprologue": "as triton, Inductor's prologue fusion off (nothing fused into flex_attention's loads)",
    "triton-c6k": "as triton, loss chunks of at most 6176 rows (193 blocks of 32) instead of 4096",
    "triton-c8k": "as triton, loss chunks of at most 8224 rows (257 blocks of 32) instead of 4096",
    "dflash2": "as triton, the DFlash2 drafter (--arch dflash2: block convolutions, candidate selector top-16 rank 256)",
    "dflash2-conv": "as dflash2, the convolutions through trainer/kernels/conv_triton.py (DFLASH_CONV_KERNEL=triton)",
    "dflash2-autograd": "as dflash2, the convolutions as before the GroupedDynamicConv rewrite (autograd through grouped_dynamic_conv, "
    "DFLASH_CONV_KERNEL=autograd)",
    "dflash2-ibwd": "as dflash2, the output-side convolutions' backward compiled by Inductor (DFLASH_CONV_BACKWARD="
    "inductor, the form before conv_bwd_triton) instead of trainer/kernels/conv_bwd_triton.py's kernel",
    "dflash2-tin": "as dflash2, the input-side convolutions' kernel gradients through trainer/kernels/conv_in_triton.py's "
    "kernel (DFLASH_CONV_INPUT_BACKWARD=triton) instead of Inductor's code (not yet the default)",
    "dflash2-nd": "as dflash2, Inductor's N-D tiling preferred for element-wise kernels (triton.prefer_nd_tiling): the "
    "convolutions' per-row and per-group loads once per tile row instead of per element",
    "triton-attn": "as triton, attention through our Triton kernel for the interval mask "
    "(--attention-kernel triton, trainer/kernels/attention_triton.py) instead of flex_attention",
    "triton-s8": "as triton, as bench/results/step.md 2026-12-02 'The 8B seed step toward 56% MFU' ran it: the mask built before the context's GEMM is queued, the gradient "
    "clip as a pass of its own (clip_grad_norm_), the anchor slot's logits computed",
}


def _embed_context_fp32(fc: torch.nn.Module, hidden_norm: torch.nn.Module, ctx_features: torch.Tensor) -> torch.Tensor:
    return hidden_norm(fc(ctx_features))  # embed_context without the cast back (RMSNorm's fp32 output)


def _mask_first(
    forward: Callable[..., torch.Tensor],
    build: Callable[..., attention.DraftMask],
    ctx: torch.Tensor,
    emb: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    mask: attention.DraftMask | str,
) -> torch.Tensor:
    """DFlashDrafter.forward with the mask built before the context's GEMM is queued, as before bench/results/step.md 2026-12-02 "The last 8-15 ms of the 8B seed step"."""
    if isinstance(mask, str):
        mask = build(anchors, keep, ctx.shape[1], backend=mask)
    return forward(ctx, emb, anchors, keep, mask)


CONV_VARIANTS = ("dflash2-conv", "dflash2-autograd", "dflash2-ibwd", "dflash2-tin")


def run_step_variant(preset: str, shape: Shape, variant: str, device: torch.device, args: argparse.Namespace) -> dict:
    """One variant's training step on one shape: build, patch, time; returns its row of the table."""
    cfg, dcfg = preset_config(preset, shape, variant_flags(variant))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        drafter = DFlashDrafter(dcfg)
        embed = torch.randn(dcfg.vocab_size, dcfg.hidden_size, dtype=dtype) * 0.02
        lm_head = torch.randn(dcfg.vocab_size, dcfg.hidden_size, dtype=dtype) * 0.02
    if variant in CONV_VARIANTS:  # before DrafterSide compiles (graphs see it)
        select_conv_kernels(drafter, variant)
    side = DrafterSide(
        cfg,
        drafter,
        embed,
        lm_head,
        device,
        total_steps=1000,
        compile=variant != "eager",
        activation_checkpointing=variant == "act-ckpt",
        compile_backend=getattr(args, "compile_backend", "inductor"),
    )
    batch = synthetic_batch(dcfg, shape, cfg.gamma, device, sorted_anchors=variant != "unsorted")
    soft = variant in ("soft", "soft-triton")
    features = synthetic_features(batch, dcfg, shape, device, dtype, soft=soft)
    patch_for_variant(variant, side, drafter)

    def step() -> None:
        side.forward_backward(features, batch.weight_sum, float(batch.num_blocks))  # noqa: F821 - del'd below
        side.optimizer_step()  # noqa: F821

    timing = time_steps(step, device, args)
    flops = step_flops(dcfg, shape, batch.anchors, batch.keep, soft=soft)
    if args.profile:
        from trainer.bench.bench_profile import print_profile, profile_steps

        print_profile(f"{preset} {shape.name} {variant}", profile_steps(step, device), flops)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del side, drafter, features
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return step_row(preset, shape, variant, timing, flops, peak)


def variant_flags(variant: str) -> list[str]:
    """The train flags a step variant adds to its preset, --loss-kernels always among them."""
    # The loss kernels are explicit, so a variant measures the same thing whatever --loss-kernels auto picks.
    kernels = (
        "eager"
        if variant == "eager"
        else "triton"
        if variant.startswith(("triton", "soft-triton", "dflash2"))
        else "compiled"
    )
    extra = {
        "soft": ["--use-soft-labels"],
        "soft-triton": ["--use-soft-labels"],
        "cap": ["--cap-lambda", "0.1"],
        "triton-foreach": ["--adamw", "foreach"],
        "triton-adamw": ["--adamw", "triton"],
        "triton-c6k": ["--loss-chunk-size", "6176"],
        "triton-c8k": ["--loss-chunk-size", "8224"],
        "dflash2": ["--arch", "dflash2"],
        "dflash2-conv": ["--arch", "dflash2"],
        "dflash2-autograd": ["--arch", "dflash2"],
        "dflash2-nd": ["--arch", "dflash2"],
        "dflash2-ibwd": ["--arch", "dflash2"],
        "dflash2-tin": ["--arch", "dflash2"],
    }.get(variant, [])
    return extra + ["--loss-kernels", kernels]


def select_conv_kernels(drafter: DFlashDrafter, variant: str) -> None:
    """Set every BlockConv's kernels as a CONV_VARIANTS variant measures them."""
    for module in drafter.modules():
        if isinstance(module, BlockConv) and variant == "dflash2-ibwd":
            module.backward_kernel = "inductor"
        elif isinstance(module, BlockConv) and variant == "dflash2-tin":
            module.input_backward_kernel = "triton"
        elif isinstance(module, BlockConv):
            module.kernel = "triton" if variant == "dflash2-conv" else "autograd"


def synthetic_features(
    batch: Batch, dcfg: DrafterConfig, shape: Shape, device: torch.device, dtype: torch.dtype, *, soft: bool
) -> FeatureBatch:
    """Random context taps for `batch` (and the teacher's final hidden state with soft labels)."""
    ctx = torch.randn(shape.rows, shape.ctx, dcfg.num_taps * dcfg.hidden_size, device=device, dtype=dtype)
    teacher = torch.randn(shape.rows, shape.ctx, dcfg.hidden_size, device=device, dtype=dtype) if soft else None
    return FeatureBatch(batch=batch, ctx_features=ctx, teacher_hidden=teacher)


def patch_for_variant(variant: str, side: DrafterSide, drafter: DFlashDrafter) -> None:
    """The variants that change the step after it is built: the loss, the drafter's calls, attention's and
    Inductor's settings (bench_step's module_settings_restored puts the module settings back)."""
    if variant == "ckpt-loss":
        side.loss_fn = lambda h, w, lab, wts, **kw: _ckpt_loss_result(h, w, lab, wts, kw)
    if variant == "triton-s7":
        drafter.context_call, drafter.output_call = _embed_context_fp32, finish_hidden  # eager, as before
        attention.FLEX_MASK_FORM = "predicate"  # bench_step restores the module settings after the variant
        attention.FLEX_PAD_TO_TILES = False
    if variant == "triton-attn":
        side.backend = attention.cuda_backend("triton")
    if variant == "triton-tma":
        attention.FLEX_KERNEL_OPTIONS = {**(attention.FLEX_KERNEL_OPTIONS or {}), "USE_TMA": True}
    if variant == "triton-nopad":
        attention.FLEX_PAD_TO_TILES = False
    if variant == "triton-ctx32":
        drafter.context_call = private_compile(_embed_context_fp32)
    if variant == "triton-noprologue":
        torch._inductor.config.prologue_fusion = False  # read when the layer compiles, at the first warm-up step
    if variant == "dflash2-nd":
        torch._inductor.config.triton.prefer_nd_tiling = True  # likewise; restored by module_settings_restored
    if variant == "triton-s8":
        side.clip_in_adamw = False
        loss_module.SKIP_ANCHOR_SLOT = False  # restored by module_settings_restored
        setattr(drafter, "forward", functools.partial(_mask_first, drafter.forward, drafter.build_mask))  # noqa: B010


@dataclasses.dataclass
class StepTiming:
    """What time_steps measured: the per-call times (ms), back to back (ms a step), warm-up and recompiles."""

    times: list[float]
    b2b: float
    warm_s: float
    recompiles: int


def time_steps(step: Callable[[], None], device: torch.device, args: argparse.Namespace) -> StepTiming:
    """Warm `step` up (compiles happen there), then time `--iters` calls each and back to back."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warm_s = time.perf_counter() - t0
    graphs_before = recompile_count()
    times = time_ms(step, device, warmup=0, iters=args.iters)
    # The same steps back to back, one sync at the end (a training loop that reads nothing from the device
    # between its log steps): the host queues step n+1 (the mask build, the launches) while step n runs, so the
    # per-call time's launch gaps and host-side mask build leave the figure.
    b2b = back_to_back_ms(step, device, args.iters)
    recompiles = recompile_count() - graphs_before
    return StepTiming(times=times, b2b=b2b, warm_s=warm_s, recompiles=recompiles)


def step_row(preset: str, shape: Shape, variant: str, timing: StepTiming, flops: float, peak: float) -> dict:
    """The table's row of one step variant: the median time and the rates derived from it."""
    ms = statistics.median(timing.times)
    return {
        "preset": preset,
        "shape": shape.name,
        "variant": variant,
        "ms": ms,
        "ms_spread": max(timing.times) - min(timing.times),
        "ms_b2b": timing.b2b,
        "ms_sample_b2b": timing.b2b / shape.rows,
        "ms_sample": ms / shape.rows,  # per sequence, as SpecForge reports its steps
        "tflops": flops / (ms * 1e-3) / 1e12,
        "block_tok_s": shape.block_tokens / (ms * 1e-3),
        "ctx_tok_s": shape.rows * shape.ctx / (ms * 1e-3),
        "peak_gib": peak,
        "warmup_s": timing.warm_s,
        "recompiles": timing.recompiles,
        "flops": flops,
    }


def _ckpt_loss_result(hidden, weight, labels, weights, kw):  # adapter: the baseline loss in LossResult's shape
    from trainer.training.loss import LossResult

    loss = checkpointed_loss(
        hidden, weight, labels, weights.to(torch.float32), kw["normalizer"], kw.get("chunk_size") or 4096
    )
    zero = loss.detach() * 0
    return LossResult(
        loss=loss,
        ce_sum=zero,
        kl_sum=zero,
        cap_sum=zero,
        weight_sum=weights.float().sum(),
        num_blocks=zero,
        correct=torch.zeros_like(labels, dtype=torch.bool),
    )


# ------------------------------------------------------------------------------------------- verbs


@contextlib.contextmanager
def module_settings_restored() -> Iterator[None]:
    """Put back the module-level settings a variant may change (attention's mask form, kernel options and
    padding, the loss's anchor slot, Inductor's prologue fusion and N-D tiling) however the variant ends."""
    import torch._inductor.config

    saved = (
        attention.FLEX_MASK_FORM,
        attention.FLEX_KERNEL_OPTIONS,
        attention.FLEX_PAD_TO_TILES,
        attention.ATTENTION_KERNEL,
        loss_module.SKIP_ANCHOR_SLOT,
        torch._inductor.config.prologue_fusion,
        torch._inductor.config.triton.prefer_nd_tiling,
    )
    try:
        yield
    finally:
        (
            attention.FLEX_MASK_FORM,
            attention.FLEX_KERNEL_OPTIONS,
            attention.FLEX_PAD_TO_TILES,
            attention.ATTENTION_KERNEL,
            loss_module.SKIP_ANCHOR_SLOT,
            torch._inductor.config.prologue_fusion,
            torch._inductor.config.triton.prefer_nd_tiling,
        ) = saved


def bench_step(args: argparse.Namespace, device: torch.device) -> list[dict]:
    ceiling = matmul_ceiling_tflops(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak = datasheet_peak_tflops(name)
    log(f"matmul ceiling: {ceiling:.0f} TFLOP/s on {device} ({name}; datasheet peak {peak:.0f} TFLOP/s)")
    rows = []
    for shape_name in args.shape.split(","):
        for variant in args.variants.split(","):
            log(f"- {args.preset} {shape_name} {variant} ...")
            try:
                with module_settings_restored():
                    row = run_step_variant(args.preset, SHAPES[shape_name], variant, device, args)
            except Exception as exc:  # noqa: BLE001 - a variant this torch cannot run: say so, measure the rest
                log(f"  failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
                continue
            row["mfu"] = row["tflops"] / peak
            row["mfu_ceiling"] = row["tflops"] / ceiling if ceiling == ceiling else float("nan")
            rows.append(row)
            log(f"  {row['ms']:.1f} ms, {row['tflops']:.0f} TFLOP/s, peak {row['peak_gib']:.1f} GiB")
    print(
        f"{'preset':<12} {'shape':<9} {'variant':<17} {'ms':>8} {'spread':>7} {'ms/smpl':>7} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'MFU/ceil':>8} {'b2b ms':>7} {'b2b/smpl':>8} {'b2b MFU':>7} {'blk tok/s':>10} {'ctx tok/s':>10} "
        f"{'peak GiB':>8} {'warm s':>7} {'recomp':>6}"
    )
    for r in rows:
        print(
            f"{r['preset']:<12} {r['shape']:<9} {r['variant']:<17} {r['ms']:8.1f} {r['ms_spread']:7.1f} "
            f"{r['ms_sample']:7.1f} {r['tflops']:8.0f} {r['mfu']:6.1%} {r['mfu_ceiling']:8.1%} {r['ms_b2b']:7.1f} "
            f"{r['ms_sample_b2b']:8.1f} {r['flops'] / (r['ms_b2b'] * 1e-3) / 1e12 / peak:7.1%} "
            f"{r['block_tok_s']:10.0f} {r['ctx_tok_s']:10.0f} {r['peak_gib']:8.1f} {r['warmup_s']:7.1f} "
            f"{r['recompiles']:6d}"
        )
    return rows


def bench_loss(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The loss alone in GEMM-equivalents: loss fwd+bwd time / one logits GEMM over the M(B-1)/B rows it computes."""
    shape = SHAPES[args.shape.split(",")[0]]
    _, dcfg = preset_config(args.preset, shape, [])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    M, H, V = shape.block_tokens, dcfg.hidden_size, dcfg.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(M, H, device=device, dtype=dtype, generator=gen)).requires_grad_(True)
    teacher = torch.randn(M, H, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(V, H, device=device, dtype=dtype, generator=gen) * 0.02
    labels = torch.randint(0, V, (M,), device=device, generator=gen)
    weights = position_weights(shape.block, 7.0).to(device).repeat(M // shape.block)
    # the unit: one logits GEMM over the rows the loss computes (slot 0 of each block never is)
    supervised = hidden.detach()[: M // shape.block * (shape.block - 1)]
    gemm_ms = statistics.median(time_ms(lambda: supervised @ weight.T, device, warmup=2, iters=args.iters))
    rows = []
    kernels = make_chunk_kernels("compiled" if device.type == "cuda" else "eager")
    cap = {"cap_lambda": 0.1, "num_blocks_normalizer": M / shape.block}
    cases: list[tuple[str, ChunkKernels, dict[str, Any]]] = [
        ("ce", kernels, {}),
        ("ce+kl", kernels, {"teacher_hidden": teacher, "kl_weight": 1.0}),
        ("ce+cap", kernels, cap),
    ]
    if device.type == "cuda":  # the fused Triton CE kernel (trainer/kernels/loss_triton.py; CE and CE+CAP only)
        fused = make_chunk_kernels("triton")
        cases += [("ce-triton", fused, {}), ("ce-cap-triton", fused, cap)]
    for name, chunk_kernels, kw in cases:

        def run() -> None:
            hidden.grad = None
            out = dflash_loss(
                hidden,
                weight,
                labels,
                weights,
                block_size=shape.block,
                normalizer=float(weights.sum()),
                kernels=chunk_kernels,
                **kw,
            )
            out.loss.backward()

        ms = statistics.median(time_ms(run, device, warmup=args.warmup, iters=args.iters))
        rows.append({"loss": name, "ms": ms, "gemm_ms": gemm_ms, "gemm_equiv": ms / gemm_ms})

    def baseline() -> None:
        hidden.grad = None
        checkpointed_loss(hidden, weight, labels, weights, float(weights.sum()), 4096).backward()

    ms = statistics.median(time_ms(baseline, device, warmup=args.warmup, iters=args.iters))
    rows.append({"loss": "ckpt-ce", "ms": ms, "gemm_ms": gemm_ms, "gemm_equiv": ms / gemm_ms})
    print(f"M={M} H={H} V={V}; one logits GEMM = {gemm_ms:.2f} ms")
    print(f"{'loss':<14} {'ms':>8} {'GEMM-eq':>8}")
    for r in rows:
        print(f"{r['loss']:<14} {r['ms']:8.2f} {r['gemm_equiv']:8.2f}")
    return rows


def bench_attention(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One attention layer's fwd+bwd (and fwd alone) through the drafter's attend(): sorted vs unsorted anchors,
    full and sliding layers, BlockMask forms (--mask-forms intervals,predicate: how the mask is built, with the
    build's own time), and flex_attention kernel_options variants (--flex-options A;B;..., 'default' = torch's
    own heuristics)."""
    from trainer.model.attention import Backend, attend, build_draft_mask, parse_flex_options

    rows = []
    layers = [
        (name, window)
        for name, window in [("full_attention", None), ("sliding_attention", 2048)]
        if name.split("_")[0] in args.layers.split(",")
    ]
    for shape_name in args.shape.split(","):
        shape = SHAPES[shape_name]
        _, dcfg = preset_config(args.preset, shape, [])
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        backend: Backend = "flex" if device.type == "cuda" else "dense"
        Hq, Hkv, D = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
        Q, K = shape.anchors * shape.block, shape.ctx + shape.anchors * shape.block
        for (layer_type, window), order, form, layout in itertools.product(
            layers, args.orders.split(","), args.mask_forms.split(","), args.layouts.split(",")
        ):
            batch = synthetic_batch(dcfg, shape, 7.0, device, sorted_anchors=order == "sorted")
            attention.FLEX_MASK_FORM = form  # checked in main()

            def build() -> attention.DraftMask:
                return build_draft_mask(
                    batch.anchors,
                    batch.keep,
                    shape.ctx,
                    shape.block,
                    sliding_window=window,
                    backend=backend,
                    layer_types=[layer_type],
                )

            build_ms = statistics.median(time_ms(build, device, warmup=1, iters=5))
            mask = build()
            # bhsd: contiguous [R,h,L,D] leaves and the gradient of a sum (the bench's earlier form); bshd: as a
            # layer hands them over, transposed views of [R,L,h,D] and a random [R,Q,h,D] output gradient
            # (o_proj's input gradient, transposed back).
            dims = (lambda h, n: (shape.rows, n, h, D)) if layout == "bshd" else (lambda h, n: (shape.rows, h, n, D))
            leaves = [
                torch.randn(*dims(h, n), device=device, dtype=dtype, requires_grad=True)
                for h, n in ((Hq, Q), (Hkv, K), (Hkv, K))
            ]
            grad_out = torch.randn(*dims(Hq, Q), device=device, dtype=dtype)

            def inputs() -> list[torch.Tensor]:
                return [t.transpose(1, 2) for t in leaves] if layout == "bshd" else leaves

            def run() -> None:
                q, k, v = inputs()
                out = attend(q, k, v, mask, layer_type)
                if layout == "bshd":
                    out.backward(grad_out.transpose(1, 2))
                else:
                    out.sum().backward()

            def forward() -> None:
                q, k, v = inputs()
                with torch.no_grad():
                    attend(q, k, v, mask, layer_type)

            for options_text in args.flex_options.split(";"):
                attention.FLEX_KERNEL_OPTIONS = parse_flex_options(options_text)
                t0 = time.perf_counter()
                try:
                    ms = statistics.median(time_ms(run, device, warmup=args.warmup, iters=args.iters))
                    fwd = statistics.median(time_ms(forward, device, warmup=1, iters=args.iters))
                except Exception as exc:  # noqa: BLE001 - a config the kernel cannot take: say so, go on
                    log(f"- {options_text}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    ms = fwd = float("nan")
                log(
                    f"- {shape_name} {layer_type} {order} {form} {layout} [{options_text}]: {ms:.2f} ms fwd+bwd, "
                    f"{fwd:.2f} fwd, mask build {build_ms:.2f} ms ({time.perf_counter() - t0:.0f} s incl. compile)"
                )
                rows.append(
                    {
                        "shape": shape_name,
                        "layer": layer_type.split("_")[0],
                        "order": order,
                        "mask_form": form,
                        "layout": layout,
                        "build_ms": build_ms,
                        "ms": ms,
                        "fwd_ms": fwd,
                        "options": options_text,
                    }
                )
    print(
        f"{'shape':<7} {'layer':<8} {'order':<9} {'mask':<10} {'layout':<6} {'build ms':>8} {'fwd+bwd ms':>10} "
        f"{'fwd ms':>7} {'bwd ms':>7}  flex options"
    )
    for r in rows:
        print(
            f"{r['shape']:<9} {r['layer']:<8} {r['order']:<9} {r['mask_form']:<10} {r['layout']:<6} {r['build_ms']:8.2f} "
            f"{r['ms']:10.2f} {r['fwd_ms']:7.2f} {r['ms'] - r['fwd_ms']:7.2f}  {r['options']}"
        )
    return rows


def _fp32_taps(target: Any, batch: Any) -> torch.Tensor:
    """The taps of `target`'s own weights run in float32 (a second copy, freed before returning: ~30 GB for the
    qwen3-8b-shaped target, once): the truth both the eager and the compiled bf16 forward are rounded from."""
    from trainer.model import TargetModel

    reference = TargetModel.from_config(target.hf_config, target.layer_ids, dtype=torch.float32, device=target.device)
    reference.model.load_state_dict(target.model.state_dict())  # the same (bf16) weights, cast up
    with torch.no_grad():
        taps = TargetSide(reference, target.device).features(batch).ctx_features.float()
    del reference
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    return taps


def _relative_rms_per_tap(taps: torch.Tensor, reference: torch.Tensor, num_taps: int) -> list[float]:
    """||taps - reference|| / ||reference|| for each tap's slice of the last dim ([R,S,T*H] -> T values)."""
    pairs = zip(taps.float().chunk(num_taps, dim=-1), reference.chunk(num_taps, dim=-1))
    return [((t - r).norm() / r.norm()).item() for t, r in pairs]


def bench_pipeline(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Target + drafter on one device, end to end and sequentially (the threaded version with several drafter
    threads is bench/gpu_pipeline.py): the frozen target's prefill (context tokens/s, against the public anchor of
    ~27K tok/s for Qwen3-8B on one H200 in SGLang), the drafter step, and both back to back. The target has random
    weights and only the layers up to the highest tap (the layers above it never run: TargetModel exits early).
    --target-only: the prefill rows alone (no drafter is built or compiled)."""
    from transformers import Qwen3Config

    from trainer.model import TargetModel

    shape = SHAPES[args.shape.split(",")[0]]
    cfg, dcfg = preset_config(args.preset, shape, [])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.tiny_target is not None:
        hf = Qwen3Config(**cfg.tiny_target)
    else:
        hf = Qwen3Config(
            hidden_size=dcfg.hidden_size,
            intermediate_size=args.target_intermediate or 3 * dcfg.hidden_size,
            num_hidden_layers=max(dcfg.target_layer_ids) + 1,
            num_attention_heads=dcfg.num_attention_heads,
            num_key_value_heads=dcfg.num_key_value_heads,
            head_dim=dcfg.head_dim,
            vocab_size=dcfg.vocab_size,
            max_position_embeddings=dcfg.max_position_embeddings,
            tie_word_embeddings=False,
        )
    log(f"building a {hf.num_hidden_layers}-layer random target ({dtype}) ...")
    target = TargetModel.from_config(hf, dcfg.target_layer_ids, dtype=dtype, device=device)
    target_side = TargetSide(target, device)
    drafter_side = None
    if not args.target_only:
        drafter = DFlashDrafter(dcfg).to(device=device)
        drafter_side = DrafterSide(cfg, drafter, target.embed_weight, target.lm_head_weight, device, total_steps=1000)
    batch = synthetic_batch(dcfg, shape, cfg.gamma, device, sorted_anchors=True)

    def prefill() -> None:
        with torch.no_grad():
            target_side.features(batch)

    def drafter_step() -> None:
        assert drafter_side is not None
        drafter_side.forward_backward(features, batch.weight_sum, float(batch.num_blocks))
        drafter_side.optimizer_step()

    with torch.no_grad():
        features = target_side.features(batch)
    rows = []

    def both() -> None:
        prefill()
        drafter_step()

    def measure(timed: list[tuple[str, Callable[[], None]]]) -> None:
        for name, fn in timed:
            ms = statistics.median(time_ms(fn, device, warmup=args.warmup, iters=args.iters))
            rows.append(
                {
                    "what": name,
                    "ms": ms,
                    "ctx_tok_s": shape.rows * shape.ctx / (ms * 1e-3),
                    "block_tok_s": shape.block_tokens / (ms * 1e-3),
                }
            )

    with_drafter = [] if args.target_only else [("drafter step", drafter_step), ("prefill + step", both)]
    measure([("target prefill", prefill), *with_drafter])
    if args.target_compile:  # the same target, its layers now through the compiled call (TargetModel.compile_layers)
        reference = _fp32_taps(target, batch)
        target.compile_layers()
        with torch.no_grad():
            eager_taps = features.ctx_features
            compiled_taps = target_side.features(batch).ctx_features  # compiles here, outside the timing
        diff = (compiled_taps.float() - eager_taps.float()).abs().max().item()
        log(
            f"compiled target: largest tap difference {diff:.3g} (taps' largest magnitude {eager_taps.abs().max():.3g})"
        )
        for name, taps in (("eager", eager_taps), ("compiled", compiled_taps)):
            errors = _relative_rms_per_tap(taps, reference, len(dcfg.target_layer_ids))
            log(f"taps vs fp32, relative RMS per tap, {name}: {' '.join(f'{e:.2e}' for e in errors)}")
        measure([("target compiled", prefill), *([] if args.target_only else [("compiled + step", both)])])
    print(f"{args.preset} {shape.name}: {shape.rows} x {shape.ctx} context tokens, {shape.block_tokens} block tokens")
    print(f"{'what':<16} {'ms':>9} {'ctx tok/s':>10} {'blk tok/s':>10}")
    for r in rows:
        print(f"{r['what']:<16} {r['ms']:9.1f} {r['ctx_tok_s']:10.0f} {r['block_tok_s']:10.0f}")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "what",
        choices=["step", "loss", "attention", "pipeline"],
        help="step: drafter train step; loss: the LM-head loss; attention: the drafter's "
        "attention; pipeline: target prefill + drafter step",
    )
    parser.add_argument(
        "--preset",
        default="qwen3-8b",
        choices=tuple(PRESETS),
        help="drafter shape, random weights (default: %(default)s)",
    )
    parser.add_argument("--shape", default="seed", help=f"comma list of {', '.join(SHAPES)} (default: %(default)s)")
    parser.add_argument(
        "--variants", default="compiled,eager", help="comma list: " + ", ".join(VARIANTS) + " (default: %(default)s)"
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="step: the dynamo backend of the compiled variants; aot_eager keeps dynamo's guards and recompiles and "
        "AOT autograd without code generation (the CPU tests: Inductor's cold C++ build took minutes on a busy "
        "2-core machine) (default: %(default)s)",
    )
    parser.add_argument(
        "--iters", type=int, default=10, help="timed iterations, the median is reported (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed iterations first, compiles included (default: %(default)s)"
    )
    parser.add_argument(
        "--device",
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="device to measure on (default: %(default)s)",
    )
    parser.add_argument(
        "--target-intermediate",
        type=int,
        default=0,
        help="pipeline: the random target's MLP width (default 3 x hidden; Qwen3-8B: 12288)",
    )
    parser.add_argument(
        "--target-compile",
        action="store_true",
        help="pipeline: then the same rows with the target's layers compiled (--target-compile), and the "
        "largest difference of the taps (default: off)",
    )
    parser.add_argument(
        "--target-only",
        action="store_true",
        help="pipeline: the target's prefill rows only, no drafter built or compiled (default: off)",
    )
    parser.add_argument("--json-out", help="also write the rows as JSON to this file (default: none)")
    parser.add_argument(
        "--flex-options",
        default="default",
        help="attention: ';'-separated flex_attention kernel_options variants, each 'default' or "
        "KEY=VALUE,... (default: %(default)s)",
    )
    parser.add_argument("--layers", default="full,sliding", help="attention: full,sliding (default: %(default)s)")
    parser.add_argument("--orders", default="sorted,unsorted", help="attention: sorted,unsorted (default: %(default)s)")
    parser.add_argument(
        "--mask-forms",
        default="intervals",
        help="attention: comma list of BlockMask forms, intervals and/or predicate (default: %(default)s)",
    )
    parser.add_argument(
        "--layouts",
        default="bhsd",
        help="attention: comma list of input layouts, bhsd (contiguous) and/or bshd (as a layer hands them over) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="step: after timing, profile 3 steps and print where the time goes (CUDA only; default: off)",
    )
    parser.add_argument(
        "--stacks-every",
        type=float,
        default=0,
        help="dump every thread's stack every N s to stderr (default: 0, never)",
    )
    args = parser.parse_args(argv)
    for name in args.shape.split(","):
        if name not in SHAPES:
            print(f"error: unknown shape {name!r}\nhint: one of {', '.join(SHAPES)}", file=sys.stderr)
            return 2
    for name in args.mask_forms.split(","):
        if name not in ("intervals", "predicate"):
            print(f"error: unknown mask form {name!r}\nhint: intervals or predicate", file=sys.stderr)
            return 2
    for name in args.layouts.split(","):
        if name not in ("bhsd", "bshd"):
            print(f"error: unknown layout {name!r}\nhint: bhsd or bshd", file=sys.stderr)
            return 2
    for name in args.variants.split(","):
        if name not in VARIANTS:
            print(f"error: unknown variant {name!r}\nhint: one of {', '.join(VARIANTS)}", file=sys.stderr)
            return 2
    device = torch.device(args.device)
    if args.stacks_every:
        import faulthandler  # where a slow warm-up spends its time, without a profiler

        faulthandler.dump_traceback_later(args.stacks_every, repeat=True, file=sys.stderr)
    # Each bench shape/variant is a new static shape for the compiled code: lift Dynamo's per-code-object cache
    # limit (8) so nothing silently falls back to eager (the `recompiles` column still counts them).
    torch._dynamo.config.cache_size_limit = 64
    try:
        verbs = {"step": bench_step, "loss": bench_loss, "attention": bench_attention, "pipeline": bench_pipeline}
        with module_settings_restored():  # bench attention sets the mask form and kernel options per case
            rows = verbs[args.what](args, device)
    except TrainerInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0
