"""Attention masks for DFlash training (docs/method.md#attention-mask) and the two attention back-ends.

Layout of one batch row: queries are the N blocks' tokens (Q_LEN = N*B, block n at query rows n*B..n*B+B-1);
keys/values are ``[S context positions | N*B block tokens]`` (KV_LEN = S + N*B). The visibility predicate,
written once in :func:`visible` and used verbatim by both back-ends:

    blk    = min(q // B, N-1)                 # clamp: flex also evaluates padding tiles past Q_LEN
    off    = q % B                            # the query's slot inside its block
    ctx_ok = kv < S and kv < anchor[blk]      # strictly before the anchor: `<=` trains a drafter that accepts nothing
             [and kv >= anchor[blk] + off - (W-1)]          # sliding layers
             [and doc[kv] == doc[anchor[blk]]]              # packed rows
    blk_ok = kv >= S and (kv-S)//B == blk     # a block sees only itself ...
             [and (kv-S) % B <= off]                        # ... causally, where configured
    visible = (ctx_ok or blk_ok) and keep[blk]              # padded blocks see nothing

Back-ends:
- "dense" (CPU, tests, tiny preset): the predicate materialised as a boolean [R,1,Q,K] mask for SDPA. SDPA
  returns NaN on a fully masked row (softmax over nothing) and the NaN also poisons the backward, so such rows
  are given an all-True mask (finite, ignored) and their output is multiplied by zero afterwards.
- "flex" (CUDA): a BlockMask per batch and per layer type, consumed by flex_attention. The BlockMask is built
  eagerly, without compiling anything (a compiled create_block_mask hung > 4 min in Triton on an H200 at a real
  shape): `visible` is rewritten per query row as two key intervals (QueryBounds: the context the block sees,
  its own block), every (128-query, 128-key) tile of each row is classified empty / partial / full from those
  intervals, and the mask_mod of the partial tiles compares against them. Where the predicate is not two
  intervals per row (doc ids in which one document comes back), the tiles and mask_mod use `visible` itself.
  The mask covers Q and K rounded up to 128 and attend() pads q, k, v to match (pad_to_tiles).
  flex_attention itself is torch.compile'd once per device (a dict keyed by device, never one process-wide
  object shared across devices). torch.compile is not thread safe (docs/method.md#compiling): warm every
  device x shape x mask variant up sequentially before worker threads start. flex_attention has no CPU
  backward, so this path refuses CPU tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from trainer.core.compile_scope import scoped

try:  # flex_attention exists in every torch this project supports; guard anyway so CPU imports never fail.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    HAVE_FLEX = True
except ImportError:  # pragma: no cover - depends on the torch build
    BlockMask = Any  # type: ignore[misc,assignment]
    HAVE_FLEX = False

Backend = Literal["dense", "flex", "triton"]
FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


def visible(
    q: Any,
    kv: Any,
    *,
    anchors_row: Any,
    keep_row: Any,
    ctx_len: int,
    block_size: int,
    num_blocks: int,
    window: int | None,
    causal: bool,
    doc_row: Any = None,
) -> Any:
    """The mask predicate (docs/method.md#attention-mask) for one batch row; works on python ints and on
    broadcastable tensors.

    anchors_row/keep_row/doc_row are indexable by block id (anchors, keep) and by position (doc ids).
    With tensors, `q` and `kv` may be index tensors (flex mask_mod, dense construction); with ints it is the
    brute-force reference used by the tests.
    """
    as_tensor = isinstance(q, torch.Tensor) or isinstance(kv, torch.Tensor)
    blk = torch.clamp(q // block_size, max=num_blocks - 1) if as_tensor else min(q // block_size, num_blocks - 1)
    off = q % block_size
    anchor = anchors_row[blk]
    ctx_ok = (kv < ctx_len) & (kv < anchor)
    if window is not None:
        ctx_ok = ctx_ok & (kv >= anchor + off - (window - 1))
    if doc_row is not None:
        # Clamp the lookups: kv >= S (block keys) and padded anchors index outside the doc row.
        kv_pos = torch.clamp(kv, max=ctx_len - 1) if as_tensor else min(kv, ctx_len - 1)
        anchor_pos = torch.clamp(anchor, 0, ctx_len - 1) if as_tensor else max(0, min(anchor, ctx_len - 1))
        ctx_ok = ctx_ok & (doc_row[kv_pos] == doc_row[anchor_pos])
    kv_blk = kv - ctx_len
    blk_ok = (kv >= ctx_len) & (kv_blk // block_size == blk)
    if causal:
        blk_ok = blk_ok & (kv_blk % block_size <= off)
    return (ctx_ok | blk_ok) & keep_row[blk]


def _visible_in_row(
    q: Any,
    kv: Any,
    row: Any,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    ctx_len: int,
    block_size: int,
    window: int | None,
    causal: bool,
) -> Any:
    """`visible` for batch row `row` (an int, or flex's batch index tensor) of a batch's anchors/keep/doc ids."""
    return visible(
        q,
        kv,
        anchors_row=anchors[row],
        keep_row=keep[row],
        ctx_len=ctx_len,
        block_size=block_size,
        num_blocks=anchors.shape[1],
        window=window,
        causal=causal,
        doc_row=None if doc_ids is None else doc_ids[row],
    )


@dataclass
class DraftMask:
    """The attention mask of one batch, one entry per layer type present in the drafter.

    dense[type] = (sdpa_mask [R,1,Q,K] bool, row_visible [R,1,Q,1] bool); flex[type] = BlockMask.
    """

    backend: Backend
    ctx_len: int
    block_size: int
    num_blocks: int
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    flex: dict[str, Any] = field(default_factory=dict)
    triton: dict[str, Any] = field(default_factory=dict)  # IntervalTable (trainer/kernels/attention_triton.py)

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.ctx_len + self.num_blocks * self.block_size


def _check_inputs(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: int | None,
    doc_ids: torch.Tensor | None,
) -> None:
    if anchors.dim() != 2 or anchors.dtype != torch.int64:
        raise ValueError(f"anchors must be an int64 tensor [rows, blocks], got {anchors.dtype} {tuple(anchors.shape)}")
    if keep.shape != anchors.shape or keep.dtype != torch.bool:
        raise ValueError(
            f"keep must be a bool tensor shaped like anchors {tuple(anchors.shape)}, "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    if anchors.shape[1] < 1:
        raise ValueError("anchors must hold at least one block per row (pad with keep=False)")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if ctx_len < 1:
        raise ValueError(f"ctx_len must be >= 1, got {ctx_len}")
    if sliding_window is not None and sliding_window < block_size:
        raise ValueError(f"sliding_window ({sliding_window}) must be >= block_size ({block_size})")
    if doc_ids is not None and (doc_ids.shape != (anchors.shape[0], ctx_len)):
        raise ValueError(f"doc_ids must be [rows, ctx_len] = {(anchors.shape[0], ctx_len)}, got {tuple(doc_ids.shape)}")


def dense_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    ctx_len: int,
    block_size: int,
    *,
    window: int | None,
    causal: bool,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The predicate materialised: bool [R, N*B, S+N*B] (True = may attend). Memory R*Q*K bytes."""
    rows, num_blocks = anchors.shape
    q_len, device = num_blocks * block_size, anchors.device
    q = torch.arange(q_len, device=device)[:, None]  # [Q,1]
    kv = torch.arange(ctx_len + q_len, device=device)[None, :]  # [1,K]
    out = []
    for r in range(rows):  # R is small (a handful of rows per batch); a python loop keeps the predicate single-sourced
        out.append(
            _visible_in_row(
                q, kv, r, anchors, keep, doc_ids, ctx_len=ctx_len, block_size=block_size, window=window, causal=causal
            )
        )
    return torch.stack(out)  # [R,Q,K]


_COMPILED_FLEX: dict = {}  # (device, replica scope) -> private compiled flex_attention (trainer.core.compile_scope)

FLEX_OPTIONS_ENV = "DFLASH_FLEX_OPTIONS"


def parse_flex_options(text: str) -> dict[str, int | bool] | None:
    """'BLOCK_M1=32,BLOCK_N1=128,num_warps=4' -> flex_attention kernel_options (None for '' or 'default').
    For experiments (bench attention --flex-options); a bad item raises ValueError naming it."""
    text = text.strip()
    if text in ("", "default"):
        return None
    options: dict[str, int | bool] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"flex option {item!r}: expected KEY=VALUE")
        value = value.strip()
        options[key.strip()] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    return options


# kernel_options for every flex_attention call (None: torch's own heuristics), from $DFLASH_FLEX_OPTIONS at import;
# benchmarks may set it before compiling. A new value recompiles (dynamo guards on the dict's contents).
FLEX_KERNEL_OPTIONS: dict[str, int | bool] | None = parse_flex_options(os.environ.get(FLEX_OPTIONS_ENV, ""))


def compiled_flex_attention(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention compiled for `device` and the calling replica's scope (uncompiled flex silently
    materialises the full score matrix). Each drafter replica gets its own copy: two worker threads sharing
    one compiled function race in dynamo's cache lookup (trainer/core/compile_scope.py)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must share one compiled object
        device = torch.device("cuda", torch.cuda.current_device())
    return scoped(_COMPILED_FLEX, device, flex_attention)


TILE = 128  # flex_attention's sparse block (query tile x key tile)
_CHUNK_BOOLS = 1 << 24  # query rows per chunk are sized so one [rows, K] bool stays <= 16 MiB


def _tile_classes(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    ctx_len: int,
    block_size: int,
    *,
    window: int | None,
    causal: bool,
    doc_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): bool [R, 1, Qt, Kt], one entry per (TILE-query tile, TILE-key tile) pair of each row.

    full = every element visible; partial = some but not all. Out-of-range elements of the last tiles (Q, K not
    multiples of TILE) count as not visible, as in create_block_mask, so a tail tile is never full.

    Evaluated with the predicate itself, per row and per chunk of query tiles, in plain tensor ops (no compile).
    Memory: every [rows, K] intermediate in `visible` is bool; the int64 ones are only [rows,1] / [1,K] index
    vectors. A whole row would be Q x K bools = 5472 x 13664 = 75 MB at the qwen3-8b seed shape and `visible`
    keeps ~4 such tensors alive (300 MB), so the query tiles go in chunks of <= 16 MiB per [rows, Kpad] bool
    (9 tiles = 1152 rows at that shape): peak ~4-5 x 16 MiB (75 MiB measured on CPU, bench/block_mask_cost.py)
    whatever R, Q, K, plus the [R,Qt,Kt] outputs (KBs). Work: R*Q*K predicate evaluations in ~15 elementwise
    kernels per chunk (5 chunks per row at the seed shape); no host sync.
    """
    rows, num_blocks = anchors.shape
    q_len, kv_len, device = num_blocks * block_size, ctx_len + num_blocks * block_size, anchors.device
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    kv = torch.arange(kv_tiles * TILE, device=device)[None, :]  # [1, Kpad] int64
    tiles_per_chunk = max(1, _CHUNK_BOOLS // (TILE * kv_tiles * TILE))
    partial = torch.empty(rows, 1, q_tiles, kv_tiles, dtype=torch.bool, device=device)
    full = torch.empty_like(partial)
    for r in range(rows):
        for t0 in range(0, q_tiles, tiles_per_chunk):
            t1 = min(q_tiles, t0 + tiles_per_chunk)
            q = torch.arange(t0 * TILE, t1 * TILE, device=device)[:, None]  # [rows_in_chunk, 1] int64
            vis = _visible_in_row(
                q, kv, r, anchors, keep, doc_ids, ctx_len=ctx_len, block_size=block_size, window=window, causal=causal
            )
            vis &= q < q_len  # padding rows/columns of
            vis &= kv < kv_len  # the tail tiles: invisible
            tiles = vis.view(t1 - t0, TILE, kv_tiles, TILE)
            any_visible = tiles.any(dim=3).any(dim=1)  # [chunk, Kt]
            all_visible = tiles.all(dim=3).all(dim=1)
            full[r, 0, t0:t1] = all_visible
            partial[r, 0, t0:t1] = any_visible & ~all_visible
    return partial, full


@dataclass(frozen=True)
class QueryBounds:
    """The mask in interval form: query row q of batch row r may see exactly the keys
    [ctx_lo, ctx_hi) and [blk_lo, blk_hi) (int32 [R, Qpad] each; Qpad = Q rounded up to TILE; the padding rows
    q >= Q see nothing: attend() pads the queries to Qpad). An empty interval has lo >= hi.

    Equal to `visible` wherever the context part is one interval, i.e. without doc ids or with doc ids that never
    decrease along a row (packed documents; `query_bounds` returns None otherwise). Why it exists: flex's
    mask_mod then costs four per-row loads and four compares per element instead of `visible`'s division,
    modulo and gathers, and a tile's class follows from R x Qpad x Kt interval tests instead of R x Q x K
    predicate evaluations (the 8B seed shape: 3.5 M instead of 450 M elements, ~15 kernels per chunk).
    """

    ctx_lo: torch.Tensor
    ctx_hi: torch.Tensor
    blk_lo: torch.Tensor
    blk_hi: torch.Tensor


def query_bounds(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    ctx_len: int,
    block_size: int,
    *,
    window: int | None,
    causal: bool,
    doc_ids: torch.Tensor | None,
) -> QueryBounds | None:
    """`visible` rewritten per query row as two key intervals (QueryBounds); None where it is not two intervals
    (doc ids that decrease somewhere in a row: one document in two runs). Needs one host sync only with doc ids."""
    rows, num_blocks = anchors.shape
    device = anchors.device
    q = torch.arange(-(-num_blocks * block_size // TILE) * TILE, device=device)  # [Qpad]
    blk = torch.clamp(q // block_size, max=num_blocks - 1)  # padding rows: any valid block (they see nothing)
    off = q % block_size
    anchor = anchors[:, blk]  # [R, Qpad]
    kept = keep[:, blk]
    ctx_hi = anchor.clamp(0, ctx_len)  # kv < S and kv < anchor
    ctx_lo = torch.zeros_like(ctx_hi)
    if window is not None:
        ctx_lo = torch.maximum(ctx_lo, anchor + off - (window - 1))  # kv >= anchor + off - (W-1)
    if doc_ids is not None:
        if bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
            return None
        # With non-decreasing ids a document is one run: doc[kv] == doc[anchor] is kv >= the run's first position
        # (its last position is >= the anchor, and kv < anchor already).
        positions = torch.arange(ctx_len, device=device).expand(rows, ctx_len)
        starts_run = torch.ones_like(doc_ids, dtype=torch.bool)
        starts_run[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        run_start = torch.where(starts_run, positions, 0).cummax(dim=1).values  # [R, S]
        ctx_lo = torch.maximum(ctx_lo, torch.gather(run_start, 1, anchor.clamp(0, ctx_len - 1)))
    blk_lo = ctx_len + blk * block_size  # a block sees only itself ...
    blk_hi = blk_lo + (off + 1 if causal else block_size)  # ... causally, where configured
    blk_lo, blk_hi = blk_lo.expand(rows, -1), blk_hi.expand(rows, -1)
    kept = kept & (q < num_blocks * block_size)  # padded blocks and the padding rows see nothing
    empty = torch.zeros((), dtype=anchor.dtype, device=device)
    return QueryBounds(*(torch.where(kept, bound, empty).to(torch.int32) for bound in (ctx_lo, ctx_hi, blk_lo, blk_hi)))


_CHUNK_TESTS = 1 << 23  # interval tests per chunk of batch rows: each [rows, Qpad, Kt] temporary stays <= 32 MiB


def _tile_classes_from_bounds(bounds: QueryBounds, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) as `_tile_classes` returns them, from the intervals: a (query tile, key tile) pair is
    full when every real query row's intervals cover the whole key tile (keys >= K count as not visible, rows
    >= Q as seeing nothing), partial when some row's intervals meet it and it is not full.

    Work: R x Qpad x Kt interval tests (3.5 M at the 8B seed shape), as few batch-row chunks as fit in
    _CHUNK_TESTS (one at the seed shape): the build is host-bound, ~20 kernel launches a chunk, and every launch
    here is GPU idle time at the start of a step (a loop per row launched 296 ops for 6 rows). No host sync."""
    rows, q_pad = bounds.ctx_lo.shape
    q_tiles, kv_tiles = q_pad // TILE, -(-kv_len // TILE)
    device = bounds.ctx_lo.device
    k0 = torch.arange(kv_tiles, device=device, dtype=torch.int32) * TILE  # [Kt] first key of each tile
    k1 = k0 + TILE
    real = (torch.arange(q_pad, device=device) < q_len)[:, None]  # [Qpad, 1]
    partial = torch.empty(rows, 1, q_tiles, kv_tiles, dtype=torch.bool, device=device)
    full = torch.empty_like(partial)
    step = max(1, _CHUNK_TESTS // (q_pad * kv_tiles))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        lo1, hi1 = bounds.ctx_lo[r0:r1, :, None], bounds.ctx_hi[r0:r1, :, None].clamp(max=kv_len)  # [r, Qpad, 1]
        lo2, hi2 = bounds.blk_lo[r0:r1, :, None], bounds.blk_hi[r0:r1, :, None].clamp(max=kv_len)
        meets = (torch.maximum(lo1, k0) < torch.minimum(hi1, k1)) | (torch.maximum(lo2, k0) < torch.minimum(hi2, k1))
        covers = ((lo1 <= k0) & (hi1 >= k1)) | ((lo2 <= k0) & (hi2 >= k1))
        # Both intervals non-empty and touching (hi1 == lo2 == S: an anchor at S, block 0): one interval.
        joined = (lo1 < hi1) & (lo2 < hi2) & (hi1 >= lo2)
        covers |= joined & (lo1 <= k0) & (hi2 >= k1)
        shape = (r1 - r0, q_tiles, TILE, kv_tiles)
        meets, covers = (meets & real).view(shape), (covers & real).view(shape)
        all_visible = covers.all(dim=2)
        full[r0:r1, 0] = all_visible
        partial[r0:r1, 0] = meets.any(dim=2) & ~all_visible
    return partial, full


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [R,1,Qt,Kt] -> (num_blocks int32 [R,1,Qt], indices int32 [R,1,Qt,Kt]): per query tile, the marked key
    tiles in ascending order first (a stable descending sort, the same layout create_block_mask produces)."""
    as_int = tiles.to(torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(dim=-1).to(torch.int32), order.to(torch.int32)


MaskForm = Literal["intervals", "predicate"]
# How flex BlockMasks are built: "intervals" (QueryBounds; the default) or "predicate" (`visible` per element,
# the form before bench/results/step.md 2026-12-02 "The 8B seed step toward 56% MFU", kept as the general fallback and for side-by-side benches).
FLEX_MASK_FORM: MaskForm = "intervals"
# Build flex BlockMasks for Q and K rounded up to TILE (attend() pads q, k, v to match): see pad_to_tiles. Off only
# in side-by-side benches.
FLEX_PAD_TO_TILES = True


def _flex_block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    ctx_len: int,
    block_size: int,
    *,
    window: int | None,
    causal: bool,
    doc_ids: torch.Tensor | None,
) -> Any:
    """The BlockMask of one batch and layer type, built without compiling anything.

    A compiled create_block_mask was measured to hang > 4 min in Triton's make_llir on an H200 for the qwen3-8b
    seed shape (Q=5472, K=13664, neither a multiple of 128), and an uncompiled one materialises [R,Q,K] at once.
    Here the tiles are classified (from QueryBounds, or by `_tile_classes` where the mask is not two intervals
    per query or FLEX_MASK_FORM is "predicate") and handed to BlockMask.from_kv_blocks: partial tiles keep mask_mod
    for element-wise masking, full tiles skip it, empty tiles are never visited.
    The mask is for Q and K rounded up to TILE (`seq_lengths`); the padding rows and keys are never visible.
    """
    rows, num_blocks = anchors.shape
    q_len, kv_len = num_blocks * block_size, ctx_len + num_blocks * block_size
    bounds = None
    if FLEX_MASK_FORM == "intervals":
        bounds = query_bounds(anchors, keep, ctx_len, block_size, window=window, causal=causal, doc_ids=doc_ids)

    if bounds is not None:
        ctx_lo, ctx_hi, blk_lo, blk_hi = bounds.ctx_lo, bounds.ctx_hi, bounds.blk_lo, bounds.blk_hi

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            in_context = (kv_idx >= ctx_lo[b, q_idx]) & (kv_idx < ctx_hi[b, q_idx])
            return in_context | ((kv_idx >= blk_lo[b, q_idx]) & (kv_idx < blk_hi[b, q_idx]))

        partial, full = _tile_classes_from_bounds(bounds, q_len, kv_len)
    else:

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            row_visible = _visible_in_row(
                q_idx,
                kv_idx,
                b,
                anchors,
                keep,
                doc_ids,
                ctx_len=ctx_len,
                block_size=block_size,
                window=window,
                causal=causal,
            )
            return (q_idx < q_len) & row_visible  # the padding rows (attend() pads to tile multiples) see nothing

        partial, full = _tile_classes(anchors, keep, ctx_len, block_size, window=window, causal=causal, doc_ids=doc_ids)
    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    # Keyword arguments only: these seven exist with these names in torch 2.5 .. 2.13 (GPU machine runs 2.11).
    return BlockMask.from_kv_blocks(
        kv_num_blocks=kv_num_blocks,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num_blocks,
        full_kv_indices=full_kv_indices,
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        # Tile multiples: attend() pads q, k, v to these lengths, so flex compiles its IS_DIVISIBLE kernels (no
        # bound check, modulo or masked load per element); the padding keys are never visible (kv < K always).
        seq_lengths=(partial.shape[2] * TILE, partial.shape[3] * TILE) if FLEX_PAD_TO_TILES else (q_len, kv_len),
    )


def build_draft_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    ctx_len: int,
    block_size: int,
    *,
    sliding_window: int | None = None,
    causal_full: bool = False,
    causal_sliding: bool = True,
    backend: Backend = "dense",
    doc_ids: torch.Tensor | None = None,
    layer_types: Iterable[str] | None = None,
) -> DraftMask:
    """Build the per-layer-type masks of one batch.

    anchors [R,N] int64 (sorted ascending per row for speed; any order is correct), keep [R,N] bool (False =
    padded block), ctx_len = S, doc_ids [R,S] optional (packed rows). layer_types selects which masks to build
    (default: full, plus sliding when sliding_window is set). Raises ValueError on malformed input.
    """
    _check_inputs(anchors, keep, ctx_len, block_size, sliding_window, doc_ids)
    wanted = list(layer_types) if layer_types is not None else [FULL] + ([SLIDING] if sliding_window else [])
    for lt in wanted:
        if lt not in LAYER_TYPES:
            raise ValueError(f"unknown layer type {lt!r}; expected one of {LAYER_TYPES}")
        if lt == SLIDING and sliding_window is None:
            raise ValueError("a sliding_attention layer needs sliding_window to be set")
    if backend == "triton" and not _triton_attention_usable(anchors.device):
        backend = "flex"  # one log line said why (_triton_attention_usable)
    if backend in ("flex", "triton"):
        if not HAVE_FLEX:
            raise RuntimeError("this torch build has no flex_attention; use backend='dense'")
        if anchors.device.type != "cuda" and backend == "flex":
            raise ValueError("backend='flex' needs CUDA tensors (flex_attention has no CPU backward); use 'dense'")
    elif backend != "dense":
        raise ValueError(f"unknown attention backend {backend!r}; expected 'dense', 'flex' or 'triton'")

    mask = DraftMask(backend=backend, ctx_len=ctx_len, block_size=block_size, num_blocks=anchors.shape[1])
    for lt in dict.fromkeys(wanted):
        window = sliding_window if lt == SLIDING else None
        causal = causal_sliding if lt == SLIDING else causal_full
        bounds = None
        if backend == "triton":
            bounds = query_bounds(anchors, keep, ctx_len, block_size, window=window, causal=causal, doc_ids=doc_ids)
        if bounds is not None:
            from trainer.kernels.attention_triton import build_table

            q_len = anchors.shape[1] * block_size
            mask.triton[lt] = build_table(
                bounds.ctx_lo, bounds.ctx_hi, bounds.blk_lo, bounds.blk_hi, q_len, ctx_len + q_len
            )
        elif backend in ("flex", "triton"):  # triton: doc ids that are not one run each fall back to flex here
            mask.flex[lt] = _flex_block_mask(
                anchors, keep, ctx_len, block_size, window=window, causal=causal, doc_ids=doc_ids
            )
        else:
            allowed = dense_mask(anchors, keep, ctx_len, block_size, window=window, causal=causal, doc_ids=doc_ids)
            row_visible = allowed.any(dim=-1, keepdim=True)  # [R,Q,1]
            sdpa_mask = allowed | ~row_visible  # fully masked rows: attend anywhere
            mask.dense[lt] = (sdpa_mask.unsqueeze(1), row_visible.unsqueeze(1))
    return mask


# The attention kernel on CUDA (--attention-kernel / $DFLASH_ATTENTION_KERNEL): "flex" (flex_attention with a
# BlockMask), "triton" (trainer/kernels/attention_triton.py: our kernel for the interval form) or "auto" (triton on
# Hopper, where it was measured: bench/results/kernels.md 2026-12-05 ("The attention backward's dQ path" and after); flex elsewhere, e.g. Blackwell's ~100 KB parts,
# where only the one-stage rung fits and it was never timed). The variable overrides the flag's default only.
ATTENTION_KERNEL_ENV = "DFLASH_ATTENTION_KERNEL"
ATTENTION_KERNEL: str = os.environ.get(ATTENTION_KERNEL_ENV, "").strip()
_TRITON_USABLE: dict[str, bool] = {}


def cuda_backend(kernel: str, capability: tuple[int, int] | None = None) -> Backend:
    """The back-end a CUDA drafter builds its masks for: `kernel` is flex, triton or auto (triton where the device's
    compute `capability` is 9.x, else flex); ValueError on an unknown name. Whether triton then compiles within the
    device's shared memory is build_masks' check (flex, with one log line, when it does not)."""
    if kernel not in ("auto", "flex", "triton"):
        raise ValueError(f"attention kernel {kernel!r}: expected 'auto', 'flex' or 'triton'")
    if kernel == "auto":
        return "triton" if capability is not None and capability[0] == 9 else "flex"
    return "triton" if kernel == "triton" else "flex"


def _triton_attention_usable(device: torch.device) -> bool:
    """Whether our Triton attention compiles within this device's shared memory (once per device; one log line
    when it does not, and the masks are then built for flex)."""
    key = str(device)
    if key not in _TRITON_USABLE:
        from trainer.kernels.attention_triton import usable

        ok, why = usable(device)
        if not ok:
            import sys

            print(f"attention: the triton kernel cannot run on {device} ({why}); using flex", file=sys.stderr)
        _TRITON_USABLE[key] = ok
    return _TRITON_USABLE[key]


def pad_to_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [R,Hq,Q,D], k/v [R,Hkv,K,D] with zero rows appended up to the block mask's lengths (Q and K rounded up to
    TILE; those rows and keys are never visible). Why: flex then compiles its IS_DIVISIBLE kernels, without a
    bound check, modulo and masked load per element; inside a compiled layer the pads fuse into the kernels that
    produce q, k and v, so they cost no extra pass. The caller slices the output back to Q rows."""
    q_pad, kv_pad = block_mask.seq_lengths
    q = F.pad(q, (0, 0, 0, q_pad - q.shape[2]))
    return q, F.pad(k, (0, 0, 0, kv_pad - k.shape[2])), F.pad(v, (0, 0, 0, kv_pad - v.shape[2]))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DraftMask, layer_type: str) -> torch.Tensor:
    """Masked attention. q [R,Hq,Q,D], k/v [R,Hkv,K,D] (Hq a multiple of Hkv) -> [R,Hq,Q,D].

    Rows that may see nothing (padded blocks) return exactly 0 on both back-ends, with zero gradient.
    """
    if q.shape[2] != mask.q_len or k.shape[2] != mask.kv_len:
        raise ValueError(
            f"attention shapes Q={q.shape[2]}, K={k.shape[2]} do not match the mask (Q={mask.q_len}, K={mask.kv_len})"
        )
    gqa = q.shape[1] != k.shape[1]
    if layer_type in mask.triton:
        from trainer.kernels.attention_triton import interval_attention

        return interval_attention(q, k, v, mask.triton[layer_type])
    if mask.backend in ("flex", "triton"):
        if layer_type not in mask.flex:
            raise KeyError(f"mask has no {layer_type!r} entry (built for {sorted(mask.flex)})")
        # Inside a compiled layer the plain function is traced into the layer's graph; outside, the replica's
        # own compiled copy runs.
        flex: Callable[..., Any] = flex_attention
        if not torch.compiler.is_compiling():
            flex = compiled_flex_attention(q.device)
        block_mask = mask.flex[layer_type]
        options = {"kernel_options": FLEX_KERNEL_OPTIONS} if FLEX_KERNEL_OPTIONS is not None else {}
        out = flex(*pad_to_tiles(q, k, v, block_mask), block_mask=block_mask, enable_gqa=gqa, **options)
        return out[:, :, : q.shape[2]]
    if layer_type not in mask.dense:
        raise KeyError(f"mask has no {layer_type!r} entry (built for {sorted(mask.dense)})")
    sdpa_mask, row_visible = mask.dense[layer_type]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=gqa)
    return out * row_visible.to(out.dtype)  # zero (not NaN) for rows that see nothing; their gradient is 0 too
