"""Draft attention masks: the dense mask against a brute-force reading of docs/method.md#attention-mask, the SDPA
path's handling of fully masked rows, the flex mask_mod (forward, CPU eager) against the dense path, and bad
input."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from trainer.core.compile_scope import replica_scope
from trainer.model.attention import (
    FULL,
    SLIDING,
    _flex_block_mask,
    attend,
    build_draft_mask,
    compiled_flex_attention,
    dense_mask,
    pad_to_tiles,
)

torch.set_num_threads(1)


def brute_force_visible(
    anchors: list[int], keep: list[bool], S: int, B: int, *, window: int | None, causal: bool, doc: list[int] | None
) -> list[list[bool]]:
    """docs/method.md#attention-mask written out with plain loops, independently of the code under test."""
    N = len(anchors)
    rows = []
    for q in range(N * B):
        n, off = q // B, q % B
        row = []
        for kv in range(S + N * B):
            if not keep[n]:
                row.append(False)  # padded blocks see nothing
            elif kv < S:  # context: strictly before the anchor
                ok = kv < anchors[n]
                if window is not None:  # query at anchor+off sees [anchor+off-W+1, anchor)
                    ok = ok and kv >= anchors[n] + off - (window - 1)
                if doc is not None:
                    ok = ok and doc[kv] == doc[min(anchors[n], S - 1)]
                row.append(ok)
            else:  # block tokens: only its own block
                j = kv - S
                ok = j // B == n and (not causal or j % B <= off)
                row.append(ok)
        rows.append(row)
    return rows


def random_case(rng: random.Random) -> dict:
    R, N, B, S = rng.randint(1, 3), rng.randint(1, 4), rng.randint(2, 5), rng.randint(1, 14)
    anchors, keep = [], []
    for _ in range(R):
        real = rng.randint(0, N)  # the rest are padding (keep=False)
        a = sorted(rng.randint(0, S - 1) for _ in range(real)) + [0] * (N - real)
        anchors.append(a)
        keep.append([True] * real + [False] * (N - real))
    doc = None
    if rng.random() < 0.3:
        doc = [sorted(rng.randint(0, 2) for _ in range(S)) for _ in range(R)]
    return dict(
        R=R,
        N=N,
        B=B,
        S=S,
        anchors=anchors,
        keep=keep,
        doc=doc,
        window=rng.choice([None, B, B + rng.randint(1, 6)]),
        causal=rng.random() < 0.5,
    )


@pytest.mark.parametrize("seed", range(6))
def test_dense_mask_equals_brute_force_predicate(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        c = random_case(rng)
        got = dense_mask(
            torch.tensor(c["anchors"]),
            torch.tensor(c["keep"]),
            c["S"],
            c["B"],
            window=c["window"],
            causal=c["causal"],
            doc_ids=None if c["doc"] is None else torch.tensor(c["doc"]),
        )
        for r in range(c["R"]):
            want = brute_force_visible(
                c["anchors"][r],
                c["keep"][r],
                c["S"],
                c["B"],
                window=c["window"],
                causal=c["causal"],
                doc=None if c["doc"] is None else c["doc"][r],
            )
            assert got[r].tolist() == want, c


def test_mask_invariants_on_a_larger_case() -> None:
    S, B = 40, 4
    anchors = torch.tensor([[3, 3, 10, 25, 39, 0]])
    keep = torch.tensor([[True, True, True, True, True, False]])
    m = dense_mask(anchors, keep, S, B, window=None, causal=False)[0]  # [Q,K]
    for n in range(anchors.shape[1]):
        rows = m[n * B : (n + 1) * B]
        if not keep[0, n]:
            assert not rows.any()  # padded block sees nothing
            continue
        a = int(anchors[0, n])
        assert rows[:, :a].all() and not rows[:, a:S].any()  # kv < anchor, never kv >= anchor
        own = slice(S + n * B, S + (n + 1) * B)
        assert rows[:, own].all()  # bidirectional in-block
        assert rows[:, S:].sum() == B * B  # ... and no other block


def test_sliding_and_causal_variants_of_the_mask() -> None:
    S, B, W = 30, 4, 6
    anchors, keep = torch.tensor([[20]]), torch.tensor([[True]])
    m = build_draft_mask(anchors, keep, S, B, sliding_window=W, causal_sliding=True)
    sliding = m.dense[SLIDING][0][0, 0]  # [Q,K]
    for off in range(B):
        ctx = sliding[off, :S].nonzero().flatten().tolist()
        assert ctx == list(range(20 + off - (W - 1), 20))  # the last W-1-off context positions
        assert sliding[off, S:].tolist() == [j <= off for j in range(B)]  # causal in-block
    full = m.dense[FULL][0][0, 0]
    assert full[:, :20].all() and full[:, S:].all()  # full layer: bidirectional block


def test_dense_attend_zeroes_fully_masked_rows_without_nan_gradients() -> None:
    torch.manual_seed(0)
    R, S, N, B, D = 2, 9, 3, 2, 8
    anchors = torch.tensor([[0, 4, 8], [2, 0, 0]])
    keep = torch.tensor([[True, True, True], [True, False, False]])
    mask = build_draft_mask(anchors, keep, S, B)
    q = torch.randn(R, 4, N * B, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(R, 2, S + N * B, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(R, 2, S + N * B, D, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, mask, FULL)
    assert torch.isfinite(out).all()
    assert out[1, :, B:].abs().max() == 0  # row 1's padded blocks: exactly 0
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert q.grad[1, :, B:].abs().max() == 0

    # Visible rows equal an explicit softmax over the allowed keys (GQA: kv head = q head // 2).
    allowed = dense_mask(anchors, keep, S, B, window=None, causal=False)  # [R,Q,K]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(-1, -2)) / D**0.5
    ref = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1) @ vv
    visible_rows = allowed.any(-1)  # [R,Q]
    torch.testing.assert_close(
        out.detach()[visible_rows[:, None].expand_as(out[..., 0])],
        ref.detach()[visible_rows[:, None].expand_as(ref[..., 0])],
    )


@pytest.mark.parametrize("window,causal,with_doc", [(None, False, False), (5, True, False), (None, True, True)])
def test_flex_mask_mod_matches_dense_path(window: int | None, causal: bool, with_doc: bool) -> None:
    """The flex BlockMask path cannot run its backward on CPU; its mask_mod (Q=12 and K=24 are padded to one
    128 tile, whose padding rows and keys see nothing) and its forward (eager flex, CPU) are checked here, fwd+bwd
    on GPU by bench/gpu_parity.py."""
    torch.manual_seed(1)
    R, S, N, B = 2, 13, 3, 4
    anchors = torch.tensor([[2, 5, 9], [3, 7, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    doc = torch.tensor([[0] * 6 + [1] * 7, [0] * 13]) if with_doc else None
    block_mask = _flex_block_mask(anchors, keep, S, B, window=window, causal=causal, doc_ids=doc)
    want = dense_mask(anchors, keep, S, B, window=window, causal=causal, doc_ids=doc)
    q_pad, kv_pad = block_mask.seq_lengths  # tile multiples: the padding rows and keys see nothing
    assert (q_pad, kv_pad) == (128, 128)
    got = create_mask(block_mask.mask_mod, R, 1, q_pad, kv_pad, device="cpu")[:, 0]
    assert torch.equal(got[:, : N * B, : S + N * B], want)
    assert not got[:, N * B :].any() and not got[:, :, S + N * B :].any()

    lt = SLIDING if window else FULL
    dense = build_draft_mask(
        anchors,
        keep,
        S,
        B,
        sliding_window=window,
        causal_full=causal,
        causal_sliding=causal,
        doc_ids=doc,
        layer_types=[lt],
    )
    q, k, v = torch.randn(R, 4, N * B, 8), torch.randn(R, 2, S + N * B, 8), torch.randn(R, 2, S + N * B, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile"
        flex_out = flex_attention(*pad_to_tiles(q, k, v, block_mask), block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(flex_out[:, :, : N * B], attend(q, k, v, dense, lt), atol=1e-5, rtol=1e-5)


def test_compiled_flex_is_held_per_device_and_replica_scope() -> None:
    cpu_a, cpu_b = compiled_flex_attention(torch.device("cpu")), compiled_flex_attention(torch.device("cpu"))
    meta = compiled_flex_attention(torch.device("meta"))
    assert cpu_a is cpu_b and meta is not cpu_a
    with replica_scope("replica-1"):
        own = compiled_flex_attention(torch.device("cpu"))
        assert own is compiled_flex_attention(torch.device("cpu"))
    assert own is not cpu_a
    # Each is a private copy: a separate code object, hence a separate dynamo cache (trainer/core/compile_scope.py).
    assert own._torchdynamo_orig_callable.__code__ is not cpu_a._torchdynamo_orig_callable.__code__


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(anchors=torch.tensor([[1.0]])), "int64"),
        (dict(keep=torch.tensor([[True, False]])), "keep must be"),
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(sliding_window=2), "sliding_window"),
        (dict(backend="flex"), "needs CUDA"),
        (dict(backend="xla"), "unknown attention backend"),
        (dict(layer_types=[SLIDING]), "needs sliding_window"),
        (dict(layer_types=["global"]), "unknown layer type"),
        (dict(doc_ids=torch.zeros(1, 3, dtype=torch.long)), "doc_ids must be"),
    ],
)
def test_bad_mask_input_is_a_clear_error(kwargs: dict, message: str) -> None:
    args = dict(anchors=torch.tensor([[1]]), keep=torch.tensor([[True]]), ctx_len=4, block_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        build_draft_mask(args.pop("anchors"), args.pop("keep"), args.pop("ctx_len"), args.pop("block_size"), **args)


def test_attend_rejects_shapes_the_mask_was_not_built_for() -> None:
    mask = build_draft_mask(torch.tensor([[1]]), torch.tensor([[True]]), 4, 4)
    q, kv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="do not match the mask"):
        attend(q, kv, kv, mask, FULL)
    with pytest.raises(KeyError, match="sliding_attention"):
        attend(q, torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), mask, SLIDING)
