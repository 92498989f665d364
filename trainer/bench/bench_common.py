"""Shared pieces of the benchmarks: batch shapes, timing, the matmul ceiling, FLOP counting, synthetic batches.

`trainer.bench.bench` (the `python -m trainer bench` verbs) builds on these; nothing here prints except `log`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.core.config import TrainConfig, parse_train_args
from trainer.data.batches import Batch
from trainer.model import DrafterConfig, default_target_layer_ids
from trainer.model.drafter import make_block_input_ids
from trainer.training.loss import position_weights

H200_PEAK_TFLOPS = 989.0
# Dense bf16 tensor-core peaks from the datasheets (TFLOP/s, fp32 accumulation, no sparsity), matched by a
# substring of torch.cuda.get_device_name: MFU on another card against the H200's 989 would
# mislead (an H100 PCIe peaks at 756). A card not listed gets no datasheet MFU, only the measured ceiling's.
DATASHEET_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", H200_PEAK_TFLOPS),  # SXM: the same tensor cores and clocks as the H200
    ("H200", H200_PEAK_TFLOPS),
    ("H800", H200_PEAK_TFLOPS),
    ("GH200", H200_PEAK_TFLOPS),
    ("A100", 312.0),
    ("B200", 2250.0),
)


def datasheet_peak_tflops(device_name: str) -> float:
    """The datasheet's dense bf16 peak of a card named `device_name` (torch.cuda.get_device_name), NaN if the
    table above does not know it. The longest matching key wins ("NVIDIA H100 PCIe" is "H100 PCIe", not "H100")."""
    for key, tflops in sorted(DATASHEET_PEAK_TFLOPS, key=lambda item: -len(item[0])):
        if key.lower() in device_name.lower():
            return tflops
    return float("nan")


@dataclass(frozen=True)
class Shape:
    """A batch shape: rows x context tokens, anchors per row, block size."""

    name: str
    rows: int
    ctx: int
    anchors: int
    block: int

    @property
    def block_tokens(self) -> int:
        return self.rows * self.anchors * self.block


# seed: the seed run's batch (token budget 49152, 1024 anchors, block 32); recipe: the public recipe's
# (block 16, 512 anchors per sequence, 4096-token sequences, same 16K-ish token budget per step).
SHAPES = {
    "seed": Shape("seed", rows=6, ctx=8192, anchors=171, block=32),
    "recipe": Shape("recipe", rows=4, ctx=4096, anchors=512, block=16),
    # specforge: SpecForge's published 8xH200 run (docs/benchmarks/domino-disaggregated-performance.md there):
    # batch 2 x 768 tokens, 256 anchors x block 16, its ~1.1B Qwen3-8B DFlash drafter (our qwen3-8b preset).
    "specforge": Shape("specforge", rows=2, ctx=768, anchors=256, block=16),
    "tiny": Shape("tiny", rows=2, ctx=64, anchors=8, block=8),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- measurement


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int) -> list[float]:
    """Per-call wall times in ms: CUDA events on GPU (one sync per call), perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def back_to_back_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean ms per call of `iters` calls queued back to back with one sync at the end (CUDA events around all of
    them; perf_counter on CPU): what a loop that never waits for the device between calls gets."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def matmul_ceiling_tflops(device: torch.device, n: int = 8192) -> float:
    """bf16 GEMM rate on random data (the practical ceiling MFU is also reported against)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = statistics.median(time_ms(lambda: a @ b, device, warmup=3, iters=10))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def recompile_count() -> int:
    """Graphs Dynamo has compiled so far in this process (grows on every compile and recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ------------------------------------------------------------------------------------------- FLOPs


def visible_pairs(anchors: torch.Tensor, keep: torch.Tensor, block: int, window: int | None, causal: bool) -> int:
    """Query-key pairs the mask allows: per real block, B x (context before the anchor [within the window])
    plus the in-block pairs; on sliding layers slot s sees min(anchor, W - 1 - s) context keys. Tested against
    the dense mask."""
    a = anchors[keep].double()
    if window is None:
        ctx = (a * block).sum()
    else:
        slots = torch.arange(block, dtype=torch.float64, device=a.device)
        ctx = torch.minimum(a[:, None], (window - 1 - slots).clamp(min=0)[None, :]).sum()
    inner = block * (block + 1) / 2 if causal else block * block
    return int(ctx.item() + inner * a.numel())


def step_flops(cfg: DrafterConfig, shape: Shape, anchors: torch.Tensor, keep: torch.Tensor, *, soft: bool) -> float:
    """Model FLOPs of one forward+backward (no recompute counted) for the drafter step."""
    H, D = cfg.hidden_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    block_tokens = int(keep.sum().item()) * shape.block
    ctx_tokens = shape.rows * shape.ctx
    per_layer_block = H * q_dim * 2 + H * kv_dim * 2 + 3 * H * cfg.intermediate_size  # q,o,k,v,mlp on block tokens
    per_layer_ctx = H * kv_dim * 2  # k,v re-projected per layer
    flops = 6 * cfg.num_hidden_layers * (per_layer_block * block_tokens + per_layer_ctx * ctx_tokens)
    flops += 6 * (cfg.num_taps * H * H) * ctx_tokens  # fc
    for layer_type in cfg.layer_types:
        sliding = layer_type == "sliding_attention"
        pairs = visible_pairs(
            anchors,
            keep,
            shape.block,
            cfg.sliding_window if sliding else None,
            cfg.causal_in_block["sliding_attention" if sliding else "full_attention"],
        )
        flops += 3 * 4 * D * cfg.num_attention_heads * pairs  # QK^T + PV, fwd + 2x bwd
    # LM head: slots 1..B-1 of each block only (slot 0, the anchor, has no target and is never computed)
    flops += (4 + (2 if soft else 0)) * H * cfg.vocab_size * block_tokens * (shape.block - 1) // shape.block
    if cfg.arch == "dflash2":  # docs/method.md#dflash2; the convolutions' element-wise work is not counted
        groups = H // cfg.conv_group_size
        flops += 6 * cfg.num_hidden_layers * 2 * (H * 2 * cfg.conv_kernel_size * groups) * block_tokens  # kernels
        supervised = block_tokens * (shape.block - 1) // shape.block
        rank, k = cfg.selector_rank, cfg.selector_top_k
        flops += 6 * H * rank * supervised + 6 * k * rank * supervised  # hidden projection + K-way product
    return float(flops)


# ------------------------------------------------------------------------------------------- synthetic data


def synthetic_batch(
    cfg: DrafterConfig, shape: Shape, gamma: float, device: torch.device, *, sorted_anchors: bool, seed: int = 0
) -> Batch:
    """Random tokens, every token supervised, `shape.anchors` distinct anchors per row (sorted or shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    R, S, N, B = shape.rows, shape.ctx, shape.anchors, shape.block
    input_ids = torch.randint(0, cfg.vocab_size, (R, S), generator=gen)
    anchors = torch.stack([torch.randperm(S - B, generator=gen)[:N] for _ in range(R)])
    anchors = anchors.sort(dim=1).values if sorted_anchors else anchors  # mask predicate is order-free
    keep = torch.ones(R, N, dtype=torch.bool)
    positions = anchors[:, :, None] + torch.arange(B)  # [R,N,B]
    labels = torch.gather(input_ids, 1, positions.reshape(R, -1))
    weights = position_weights(B, gamma).repeat(R, N).float()
    block_ids = make_block_input_ids(input_ids, anchors, B, cfg.mask_token_id)
    batch = Batch(
        input_ids=input_ids,
        loss_mask=torch.ones(R, S, dtype=torch.bool),
        attention_mask=torch.ones(R, S, dtype=torch.long),
        anchors=anchors,
        keep=keep,
        block_ids=block_ids,
        labels=labels,
        weights=weights,
        epoch=0,
        index=0,
        num_ctx_tokens=R * S,
        num_blocks=R * N,
        weight_sum=float(weights.sum()),
    )
    return batch.to(device)


def preset_config(preset: str, shape: Shape, extra: list[str]) -> tuple[TrainConfig, DrafterConfig]:
    """TrainConfig + DrafterConfig of a preset at a bench shape (random weights: no target is loaded)."""
    # Neither is read: the bench builds random weights and synthetic batches.
    target = [] if preset == "tiny" else ["--target-model", "(random weights)", "--data-dir", "(synthetic)"]
    cfg = parse_train_args(
        [
            "--preset",
            preset,
            *target,
            "--block-size",
            str(shape.block),
            "--output-dir",
            "/tmp/bench",
            "--wandb",
            "off",
            *extra,
        ]
    )
    L = cfg.num_target_layers or 2
    # The ignores below: every preset sets these fields (None only means "take it from the target").
    dcfg = DrafterConfig(
        hidden_size=cfg.hidden_size,  # type: ignore[arg-type]
        intermediate_size=cfg.intermediate_size,  # type: ignore[arg-type]
        num_hidden_layers=cfg.num_draft_layers,
        num_attention_heads=cfg.num_attention_heads,  # type: ignore[arg-type]
        num_key_value_heads=cfg.num_key_value_heads,  # type: ignore[arg-type]
        head_dim=cfg.head_dim,  # type: ignore[arg-type]
        vocab_size=cfg.vocab_size,  # type: ignore[arg-type]
        block_size=shape.block,
        target_layer_ids=cfg.target_layer_ids or default_target_layer_ids(L, cfg.num_draft_layers),
        num_target_layers=L,
        mask_token_id=cfg.mask_token_id,  # type: ignore[arg-type]
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        layer_types=cfg.layer_types(),
        sliding_window=cfg.sliding_window,
        max_position_embeddings=max(cfg.max_position_embeddings, shape.ctx + shape.block),
        arch=cfg.arch,
        conv_kernel_size=cfg.conv_kernel_size,
        conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k,
    )
    return cfg, dcfg


# ------------------------------------------------------------------------------------------- variants


def checkpointed_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normalizer: float,
    chunk: int,
) -> torch.Tensor:
    """Baseline: chunked CE with recomputation (logits rebuilt in backward: 3 GEMMs per chunk)."""
    from torch.utils.checkpoint import checkpoint

    def piece(h: torch.Tensor, lab: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logits = (h.to(weight.dtype) @ weight.T).float()  # the drafter's final norm may hand over fp32 hidden
        return (torch.nn.functional.cross_entropy(logits, lab, reduction="none") * w).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(
            piece, hidden[s : s + chunk], labels[s : s + chunk], weights[s : s + chunk], use_reentrant=False
        )
    return total / normalizer
