"""The compile-free flex BlockMask builder (`_flex_block_mask`) against torch's own uncompiled
`create_block_mask` on the same predicate, the meaning of its full/partial split against the dense mask, and the
attention it drives (CPU, eager) against the dense SDPA path.

Eager flex_attention on CPU evaluates mask_mod on every element and ignores the tile lists, so it alone cannot
catch a wrong tile classification; `block_sparse_attention` below therefore also replays what the GPU kernel
does with the lists (full tiles without mask_mod, partial tiles with it, unlisted tiles skipped).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

import trainer.model.attention as attention
from trainer.model.attention import (
    FULL,
    SLIDING,
    TILE,
    _flex_block_mask,
    attend,
    build_draft_mask,
    dense_mask,
    pad_to_tiles,
    query_bounds,
)

torch.set_num_threads(1)


def random_case(rng: random.Random, *, with_full_tiles: bool = False) -> dict[str, Any]:
    """A few rows whose Q and K span several 128-tiles and are (almost always) not multiples of 128.
    with_full_tiles: long context, late anchors, no window/doc ids, never all padding (full tiles guaranteed)."""
    R, B = rng.randint(1, 2), rng.choice([2, 3, 5, 16, 32, 48])
    N = max(1, rng.randint(100, 600) // B)
    S = rng.randint(300, 500) if with_full_tiles else rng.randint(1, 500)
    low = (
        S // 2 if with_full_tiles else rng.choice([0, S // 2, S - S // 8])
    )  # late anchors make fully visible context tiles
    anchors = torch.randint(low, S, (R, N), generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
    if rng.random() < 0.6:
        anchors = anchors.sort(dim=1).values
    keep = torch.ones(R, N, dtype=torch.bool)
    for r in range(R):
        padded = rng.choice(
            [0, 0, 1, N // 3] + ([] if with_full_tiles else [N])
        )  # trailing padded blocks (keep=False) ...
        keep[r, N - padded :] = False
        if rng.random() < 0.5:
            anchors[r, N - padded :] = 0  # ... anchored at 0 as the data loader pads
    doc = None
    if rng.random() < 0.35 and not with_full_tiles:
        doc = torch.randint(0, 3, (R, S)).sort(dim=1).values
    window = None if with_full_tiles else rng.choice([None, None, B, B + rng.randint(1, 200)])
    return dict(anchors=anchors, keep=keep, S=S, B=B, window=window, causal=rng.random() < 0.5, doc=doc)


def build(c: dict[str, Any]) -> Any:
    return _flex_block_mask(
        c["anchors"], c["keep"], c["S"], c["B"], window=c["window"], causal=c["causal"], doc_ids=c["doc"]
    )


def tile_sets(num_blocks: torch.Tensor, indices: torch.Tensor) -> list[list[set[int]]]:
    """[R,1,Qt] + [R,1,Qt,Kt] -> per row, per query tile, the set of listed key tiles."""
    return [
        [set(indices[r, 0, t, : int(num_blocks[r, 0, t])].tolist()) for t in range(num_blocks.shape[2])]
        for r in range(num_blocks.shape[0])
    ]


def padded_dense(c: dict[str, Any]) -> torch.Tensor:
    """The dense mask [R, Qt*128, Kt*128], out-of-range elements False."""
    m = dense_mask(c["anchors"], c["keep"], c["S"], c["B"], window=c["window"], causal=c["causal"], doc_ids=c["doc"])
    R, Q, K = m.shape
    out = torch.zeros(R, -(-Q // TILE) * TILE, -(-K // TILE) * TILE, dtype=torch.bool)
    out[:, :Q, :K] = m
    return out


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: Any) -> torch.Tensor:
    """What flex's kernel computes from the tile lists: full tiles unmasked, partial tiles through mask_mod,
    everything else skipped. fp32 softmax over the allowed keys; rows with none give 0."""
    R, H, Q, _ = q.shape
    K = k.shape[2]
    qi, ki = torch.arange(Q)[:, None], torch.arange(K)[None, :]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    out = torch.zeros_like(q)
    partial = tile_sets(bm.kv_num_blocks, bm.kv_indices)
    full = tile_sets(bm.full_kv_num_blocks, bm.full_kv_indices)
    for r in range(R):
        tile_q, tile_k = qi // TILE, ki // TILE
        listed_full = torch.zeros(Q, K, dtype=torch.bool)
        listed_partial = torch.zeros(Q, K, dtype=torch.bool)
        for t in range(len(full[r])):
            for kt in full[r][t]:
                listed_full |= (tile_q == t) & (tile_k == kt)
            for kt in partial[r][t]:
                listed_partial |= (tile_q == t) & (tile_k == kt)
        allowed = listed_full | (listed_partial & bm.mask_mod(torch.tensor(r), torch.tensor(0), qi, ki))
        scores = (q[r] @ k[r].transpose(-1, -2)) / q.shape[-1] ** 0.5
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        out[r] = probs @ v[r]
    return out


@pytest.mark.parametrize("form", ["intervals", "predicate"])
@pytest.mark.parametrize("seed", range(4))
def test_block_mask_equals_uncompiled_create_block_mask(seed: int, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tiles, same order, same split as create_block_mask(_compile=False) on the same mask_mod; the split
    means what the dense mask (`visible`) says, for both mask forms. Odd seeds shrink the predicate form's chunk
    so one row is classified in several query chunks."""
    monkeypatch.setattr(attention, "FLEX_MASK_FORM", form)
    if seed % 2:
        monkeypatch.setattr(attention, "_CHUNK_BOOLS", 3 * TILE * TILE * 4)
    rng = random.Random(seed)
    kinds = {"full": 0, "partial": 0, "chunks>1": 0}
    for i in range(4):
        c = random_case(rng, with_full_tiles=i == 3)
        R, N = c["anchors"].shape
        Q, K = N * c["B"], c["S"] + N * c["B"]
        got = build(c)
        q_pad, kv_pad = -(-Q // TILE) * TILE, -(-K // TILE) * TILE  # the mask is for tile multiples
        want = create_block_mask(got.mask_mod, R, 1, q_pad, kv_pad, device="cpu", _compile=False)
        assert got.seq_lengths == want.seq_lengths == (q_pad, kv_pad)
        assert torch.equal(got.to_dense(), want.to_dense()), c
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, c)
        assert got.kv_indices.dtype == got.full_kv_indices.dtype == got.kv_num_blocks.dtype == torch.int32
        assert tile_sets(got.kv_num_blocks, got.kv_indices) == tile_sets(want.kv_num_blocks, want.kv_indices)
        assert tile_sets(got.full_kv_num_blocks, got.full_kv_indices) == tile_sets(
            want.full_kv_num_blocks, want.full_kv_indices
        )

        dense = padded_dense(c)
        assert torch.equal(got.to_dense(), want.to_dense())
        grid = create_mask(got.mask_mod, R, 1, q_pad, kv_pad, device="cpu")[:, 0]
        assert torch.equal(grid, dense), c  # mask_mod = the predicate; padding rows and keys see nothing
        partial, full = (
            tile_sets(got.kv_num_blocks, got.kv_indices),
            tile_sets(got.full_kv_num_blocks, got.full_kv_indices),
        )
        for r in range(R):
            for t in range(dense.shape[1] // TILE):
                for kt in range(dense.shape[2] // TILE):
                    tile = dense[r, t * TILE : (t + 1) * TILE, kt * TILE : (kt + 1) * TILE]
                    if kt in full[r][t]:
                        assert tile.all() and kt not in partial[r][t]
                    elif kt in partial[r][t]:
                        assert tile.any() and not tile.all()
                    else:
                        assert not tile.any()
            kinds["full"] += sum(map(len, full[r]))
            kinds["partial"] += sum(map(len, partial[r]))
        kinds["chunks>1"] += attention._CHUNK_BOOLS // (TILE * dense.shape[2]) < dense.shape[1] // TILE
    assert kinds["full"] and kinds["partial"], kinds  # the split was exercised
    assert kinds["chunks>1"] or seed % 2 == 0, kinds  # ... and the predicate form's chunking


def case_bounds(c: dict[str, Any]) -> tuple[Any, torch.Tensor]:
    """QueryBounds of a case and the predicate on the same padded grid [R, Qpad, Kpad]."""
    bounds = query_bounds(
        c["anchors"], c["keep"], c["S"], c["B"], window=c["window"], causal=c["causal"], doc_ids=c["doc"]
    )
    assert bounds is not None
    return bounds, padded_dense(c)


@pytest.mark.parametrize("seed", range(3))
def test_query_bounds_are_the_predicate(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per query row the two intervals hold exactly the keys `visible` allows (padding rows: none), and the tiles
    classified from them are the predicate classifier's, bit for bit: windows, doc ids, in-block causality,
    padded blocks, and anchors at S (context and own block touch: one interval covering a tile); with all batch
    rows in one chunk and with one row per chunk."""
    if seed == 1:  # one batch row per chunk of the tile classifier (otherwise all rows in one)
        monkeypatch.setattr(attention, "_CHUNK_TESTS", 1)
    rng = random.Random(200 + seed)
    cases, touching = 0, 0
    while cases < 25:
        try:
            c = random_case(rng, with_full_tiles=cases % 4 == 3)
        except RuntimeError:  # torch.randint(low, S) with low == S: not a case
            continue
        if cases % 5 == 0:
            c["anchors"][0, 0] = c["S"]
            touching += 1
        bounds, want = case_bounds(c)
        k = bounds.ctx_lo[..., None], bounds.ctx_hi[..., None], bounds.blk_lo[..., None], bounds.blk_hi[..., None]
        kv = torch.arange(want.shape[2])
        got = ((kv >= k[0]) & (kv < k[1])) | ((kv >= k[2]) & (kv < k[3]))
        R, N = c["anchors"].shape
        q_len, kv_len = N * c["B"], c["S"] + N * c["B"]
        assert torch.equal(got[:, :q_len], want[:, :q_len]), c
        assert not got[:, q_len:].any()  # the padding rows see nothing
        reference = attention._tile_classes(
            c["anchors"], c["keep"], c["S"], c["B"], window=c["window"], causal=c["causal"], doc_ids=c["doc"]
        )
        for mine, theirs in zip(attention._tile_classes_from_bounds(bounds, q_len, kv_len), reference, strict=True):
            assert torch.equal(mine, theirs), c
        cases += 1
    assert touching


def test_doc_ids_that_are_not_runs_fall_back_to_the_predicate() -> None:
    """One document in two runs (ids 0,1,0): the context a query sees is not one interval, so query_bounds
    declines and the BlockMask is built from the predicate, still equal to the dense mask."""
    S, B, N = 300, 16, 10
    anchors = torch.linspace(20, 290, N).long()[None, :]
    keep = torch.ones(1, N, dtype=torch.bool)
    doc = torch.cat([torch.zeros(100), torch.ones(100), torch.zeros(100)]).long()[None, :]
    assert query_bounds(anchors, keep, S, B, window=None, causal=False, doc_ids=doc) is None
    bm = _flex_block_mask(anchors, keep, S, B, window=None, causal=False, doc_ids=doc)
    want = dense_mask(anchors, keep, S, B, window=None, causal=False, doc_ids=doc)[0]
    q, kv = torch.arange(N * B)[:, None], torch.arange(S + N * B)[None, :]
    assert torch.equal(bm.mask_mod(torch.tensor(0), torch.tensor(0), q, kv), want)
    reference = create_block_mask(bm.mask_mod, 1, 1, *bm.seq_lengths, device="cpu", _compile=False)
    assert torch.equal(bm.to_dense(), reference.to_dense())


@pytest.mark.parametrize("form", ["intervals", "predicate"])
@pytest.mark.parametrize("seed", range(3))
def test_flex_forward_with_the_block_mask_equals_dense_sdpa(
    seed: int, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "FLEX_MASK_FORM", form)
    rng = random.Random(100 + seed)
    torch.manual_seed(seed)
    c = random_case(rng)
    c["window"] = c["window"] if seed != 1 else 2 * c["B"]  # one sliding case for sure
    R, N = c["anchors"].shape
    Q, K = N * c["B"], c["S"] + N * c["B"]
    lt = SLIDING if c["window"] else FULL
    dense = build_draft_mask(
        c["anchors"],
        c["keep"],
        c["S"],
        c["B"],
        sliding_window=c["window"],
        causal_full=c["causal"],
        causal_sliding=c["causal"],
        doc_ids=c["doc"],
        layer_types=[lt],
    )
    bm = build(c)
    q, k, v = torch.randn(R, 4, Q, 16), torch.randn(R, 2, K, 16), torch.randn(R, 2, K, 16)
    want = attend(q, k, v, dense, lt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile"
        eager = flex_attention(*pad_to_tiles(q, k, v, bm), block_mask=bm, enable_gqa=True)[:, :, :Q]
    torch.testing.assert_close(eager, want, atol=1e-5, rtol=1e-5)
    replayed = block_sparse_attention(*pad_to_tiles(q, k, v, bm), bm)[:, :, :Q]
    torch.testing.assert_close(replayed, want, atol=1e-5, rtol=1e-5)


def test_exact_multiples_of_128_and_all_padding_rows() -> None:
    """Q and K exact tile multiples (no tail), one row fully padded (no tile listed), one row fully visible
    context tiles (full tiles present)."""
    S, B, N = 256, 32, 8  # Q = 256, K = 512
    anchors = torch.tensor([[256] * N, [0] * N])
    keep = torch.tensor([[True] * N, [False] * N])
    bm = _flex_block_mask(anchors, keep, S, B, window=None, causal=False, doc_ids=None)
    full, partial = (tile_sets(bm.full_kv_num_blocks, bm.full_kv_indices), tile_sets(bm.kv_num_blocks, bm.kv_indices))
    assert full[0] == [{0, 1}, {0, 1}] and partial[0] == [{2}, {3}]  # context full; own blocks partial
    assert full[1] == [set(), set()] and partial[1] == [set(), set()]
    want = create_block_mask(bm.mask_mod, 2, 1, N * B, S + N * B, device="cpu", _compile=False)
    assert torch.equal(bm.to_dense(), want.to_dense())
