"""trainer/training/loss.py against a dense float64 reference (materialised logits, plain autograd)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.training.loss import (
    ChunkKernels,
    LossInputError,
    SoftLabelKernels,
    _logit_grad,
    default_chunk_rows,
    dflash_loss,
    fused_chunk_rows,
    make_chunk_kernels,
    position_weights,
    simulated_tau,
)

torch.set_num_threads(1)


def dense_reference(
    hidden,
    weight,
    labels,
    weights,
    *,
    block_size,
    normalizer,
    teacher_hidden=None,
    kl_weight=0.0,
    kl_temperature=1.0,
    cap_lambda=0.0,
    num_blocks_normalizer=1.0,
):
    """The loss written the obvious way: full [M, V] logits, log_softmax, autograd does the rest."""
    logits = hidden @ weight.T
    log_probs = torch.log_softmax(logits, dim=-1)
    slot = torch.arange(hidden.shape[0]) % block_size
    valid = (weights > 0) & (slot > 0)
    ce = -log_probs.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    loss = (weights * ce).sum() / normalizer
    if kl_weight > 0:
        teacher = torch.softmax(teacher_hidden @ weight.T / kl_temperature, dim=-1)
        student = torch.log_softmax(logits / kl_temperature, dim=-1)
        kl = (teacher * (teacher.log() - student)).sum(-1)
        loss = loss + kl_weight * kl_temperature**2 * (weights * kl).sum() / normalizer
    if cap_lambda > 0:
        v = valid.view(-1, block_size).to(hidden.dtype)
        accepted_run = 0.0
        log_prefix = torch.zeros(v.shape[0], dtype=hidden.dtype)
        for k in range(1, block_size):  # a python loop, unlike the cumsum in the implementation
            log_prefix = log_prefix - ce.view(-1, block_size)[:, k] * v[:, k]
            accepted_run = accepted_run + v[:, k] * torch.exp(log_prefix)
        loss = loss - cap_lambda * (accepted_run / (block_size - 1)).sum() / num_blocks_normalizer
    return loss


def make_case(blocks=7, block_size=4, hidden_size=16, vocab=37, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rows = blocks * block_size
    hidden = torch.randn(rows, hidden_size, generator=gen, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=dtype) / math.sqrt(hidden_size)
    # labels biased towards the argmax so CAP's prefix products are not all ~0
    labels = torch.where(
        torch.rand(rows, generator=gen) < 0.5,
        (hidden @ weight.T).argmax(-1),
        torch.randint(0, vocab, (rows,), generator=gen),
    )
    weights = position_weights(block_size, 2.0).to(dtype).repeat(blocks)
    weights[torch.rand(rows, generator=gen) < 0.2] = 0.0  # unsupervised / past-the-end slots
    weights[-block_size:] = 0.0  # a padded block (keep=False)
    labels[weights == 0] = -100  # what padding typically carries; must not reach gather
    teacher = torch.randn(rows, hidden_size, generator=gen, dtype=dtype)
    return hidden, weight, labels, weights, teacher


TERMS = {
    "ce": {},
    "ce+kl": {"kl_weight": 0.7, "kl_temperature": 2.0},
    "ce+cap": {"cap_lambda": 0.9, "num_blocks_normalizer": 5.0},
    "ce+kl+cap": {"kl_weight": 0.5, "kl_temperature": 0.7, "cap_lambda": 1.3, "num_blocks_normalizer": 6.0},
}


@pytest.mark.parametrize("terms", list(TERMS))
# 28 rows, B=4: 8 and 13 (-> 12) leave a short last chunk; 3 rounds up to one block
@pytest.mark.parametrize("chunk_size", [None, 3, 4, 8, 13])
def test_value_and_gradient_equal_dense_reference(terms, chunk_size):
    hidden, weight, labels, weights, teacher = make_case()
    extra = TERMS[terms]
    normalizer = float(weights.sum()) * 1.5  # as if other micro-batches shared the step
    kwargs = dict(block_size=4, normalizer=normalizer, **extra)
    if "kl_weight" in extra:
        kwargs["teacher_hidden"] = teacher

    ours_hidden = hidden.clone().requires_grad_(True)
    result = dflash_loss(ours_hidden, weight, labels, weights, chunk_size=chunk_size, **kwargs)
    result.loss.backward()

    ref_hidden = hidden.clone().requires_grad_(True)
    ref_loss = dense_reference(ref_hidden, weight, labels, weights, **kwargs)
    ref_loss.backward()

    torch.testing.assert_close(result.loss.double(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_hidden.grad, ref_hidden.grad, rtol=1e-6, atol=1e-9)
    assert weight.grad is None
    assert result.correct.tolist() == ((hidden @ weight.T).argmax(-1) == labels).tolist()


def test_sums_decompose_the_loss():
    hidden, weight, labels, weights, teacher = make_case(seed=3)
    kw = TERMS["ce+kl+cap"]
    result = dflash_loss(hidden, weight, labels, weights, block_size=4, normalizer=2.0, teacher_hidden=teacher, **kw)
    expected = (result.ce_sum + kw["kl_weight"] * kw["kl_temperature"] ** 2 * result.kl_sum) / 2.0 - kw[
        "cap_lambda"
    ] * result.cap_sum / kw["num_blocks_normalizer"]
    torch.testing.assert_close(result.loss, expected)
    assert result.weight_sum.item() == pytest.approx(float(weights.sum()))
    assert result.num_blocks.item() == 6  # 7 blocks, the last one padded
    assert result.kl_sum.item() > 0 and 0 < result.cap_sum.item() < result.num_blocks.item()


def test_zero_weight_tokens_get_no_gradient():
    hidden, weight, labels, weights, _ = make_case(seed=1)
    hidden.requires_grad_(True)
    dflash_loss(hidden, weight, labels, weights, block_size=4, normalizer=3.0, cap_lambda=1.0).loss.backward()
    assert torch.all(hidden.grad[weights == 0] == 0)
    assert torch.all(hidden.grad[weights > 0].abs().sum(-1) > 0)


def test_all_zero_weights_give_zero_loss_and_gradient_without_nan():
    hidden, weight, labels, _, teacher = make_case(seed=2)
    weights = torch.zeros(hidden.shape[0], dtype=hidden.dtype)
    hidden.requires_grad_(True)
    result = dflash_loss(
        hidden,
        weight,
        labels,
        weights,
        block_size=4,
        normalizer=0.0,
        teacher_hidden=teacher,
        kl_weight=1.0,
        cap_lambda=1.0,
        num_blocks_normalizer=0.0,
    )
    result.loss.backward()
    assert result.loss.item() == 0.0 and result.num_blocks.item() == 0
    assert torch.all(hidden.grad == 0)


def test_micro_batches_with_global_normalizer_equal_one_big_batch():
    hidden, weight, labels, weights, teacher = make_case(blocks=8, seed=4)
    kw = dict(block_size=4, teacher_hidden=None, **TERMS["ce+kl+cap"])
    real_blocks = float((weights.view(-1, 4)[:, 1:] > 0).any(1).sum())
    kw["num_blocks_normalizer"] = real_blocks
    normalizer = float(weights.sum())

    whole = hidden.clone().requires_grad_(True)
    dflash_loss(
        whole, weight, labels, weights, normalizer=normalizer, **{**kw, "teacher_hidden": teacher}
    ).loss.backward()

    accumulated = hidden.clone().requires_grad_(True)
    total = 0.0
    for part in (slice(0, 12), slice(12, 32)):  # 3 blocks + 5 blocks, different shapes
        result = dflash_loss(
            accumulated[part],
            weight,
            labels[part],
            weights[part],
            normalizer=normalizer,
            chunk_size=8,
            **{**kw, "teacher_hidden": teacher[part]},
        )
        result.loss.backward()
        total += result.loss.item()
    torch.testing.assert_close(accumulated.grad, whole.grad, rtol=1e-10, atol=1e-12)
    assert total == pytest.approx(
        dense_reference(
            hidden, weight, labels, weights, normalizer=normalizer, **{**kw, "teacher_hidden": teacher}
        ).item(),
        rel=1e-10,
    )


def test_backward_scales_with_grad_output_and_no_grad_skips_it():
    hidden, weight, labels, weights, _ = make_case(seed=5)
    a = hidden.clone().requires_grad_(True)
    (3.0 * dflash_loss(a, weight, labels, weights, block_size=4, normalizer=1.0).loss).backward()
    b = hidden.clone().requires_grad_(True)
    dflash_loss(b, weight, labels, weights, block_size=4, normalizer=1.0).loss.backward()
    torch.testing.assert_close(a.grad, 3.0 * b.grad)
    with torch.no_grad():
        evaluated = dflash_loss(b, weight, labels, weights, block_size=4, normalizer=1.0)
    assert evaluated.loss.grad_fn is None


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        return out


def test_no_tensor_larger_than_one_chunk_of_logits():
    # hidden 6 < chunk 8, so the largest legitimate tensors (W [301, 6], hidden [64, 6]) are below one chunk
    hidden, weight, labels, weights, teacher = make_case(blocks=16, hidden_size=6, vocab=301, seed=6)
    hidden.requires_grad_(True)
    with _LargestTensor() as probe:
        result = dflash_loss(
            hidden,
            weight,
            labels,
            weights,
            block_size=4,
            normalizer=1.0,
            teacher_hidden=teacher,
            kl_weight=1.0,
            cap_lambda=1.0,
            chunk_size=8,
        )
        result.loss.backward()
    assert probe.largest <= 8 * 301 < hidden.shape[0] * 301


def test_low_precision_gemm_path_stays_close_to_reference():
    hidden, weight, labels, weights, teacher = make_case(blocks=6, hidden_size=32, vocab=64, seed=7)
    kw = dict(block_size=4, normalizer=float(weights.sum()), **TERMS["ce+kl+cap"])
    h32 = hidden.float().requires_grad_(True)
    result = dflash_loss(
        h32, weight.bfloat16(), labels, weights.float(), teacher_hidden=teacher.float(), chunk_size=8, **kw
    )
    result.loss.backward()
    assert h32.grad.dtype == torch.float32 and result.loss.dtype == torch.float32
    ref_h = hidden.clone().requires_grad_(True)
    ref = dense_reference(ref_h, weight.bfloat16().double(), labels, weights, teacher_hidden=teacher, **kw)
    ref.backward()
    torch.testing.assert_close(result.loss.double(), ref.detach(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(h32.grad.double(), ref_h.grad, rtol=5e-2, atol=5e-3)


def test_default_chunk_rows_are_whole_blocks_within_budget():
    assert default_chunk_rows(248320, 32) == 1056  # 1 GiB / (4 B * V) = 1081 rows -> 33 blocks
    assert default_chunk_rows(10**9, 16) == 16  # never less than one block
    assert default_chunk_rows(100, 7, budget_bytes=4000) == 7


def test_fused_chunk_rows_are_4096_unless_the_vocabulary_is_large():
    assert fused_chunk_rows(151936, 32) == 4096  # the measured best on the H200 (bench/results/kernels.md 2026-11-29)
    assert fused_chunk_rows(248320, 32) == 2688  # 2.5 GiB / (4 B * V) = 2702 rows -> 84 blocks
    assert fused_chunk_rows(151936, 24) == 4080  # whole blocks


def test_position_weights():
    w = position_weights(5, 2.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))
    with pytest.raises(LossInputError, match="block size"):
        position_weights(1, 2.0)
    with pytest.raises(LossInputError, match="gamma"):
        position_weights(4, 0.0)


def test_simulated_tau_counts_leading_correct_valid_slots():
    correct = torch.tensor(
        [
            [False, True, True, False],  # 2 accepted -> 3
            [True, False, True, True],  # 0 accepted -> 1 (slot 0 never counts)
            [False, True, True, True],  # slot 3 invalid stops the run at 2 -> 3
            [True, True, True, True],
        ]
    )  # padded block: not real
    valid = torch.tensor(
        [[False, True, True, True], [False, True, True, True], [False, True, True, False], [False, False, False, False]]
    )
    stats = simulated_tau(correct, valid)
    assert stats.num_blocks.item() == 3 and stats.tau_sum.item() == 7
    assert stats.tau.item() == pytest.approx(7 / 3)
    acc = stats.slot_accuracy
    assert math.isnan(acc[0].item()) and acc[1:].tolist() == pytest.approx([2 / 3, 1.0, 0.5])
    empty = simulated_tau(torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.bool))
    assert empty.tau.item() == 1.0
    with pytest.raises(LossInputError):
        simulated_tau(correct, valid[:, :3])


BAD_INPUTS = [
    ({"block_size": 3}, "whole blocks"),
    ({"block_size": 1}, "block_size >= 2"),
    ({"kl_weight": 1.0}, "needs teacher_hidden"),
    ({"normalizer": -1.0}, "normalizer must be"),
    ({"normalizer": float("nan")}, "normalizer must be"),
    ({"cap_lambda": -0.5}, "cap_lambda must be"),
    ({"kl_temperature": 0.0, "kl_weight": 1.0, "teacher_hidden": "ok"}, "kl_temperature"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"teacher_hidden": "short", "kl_weight": 1.0}, "teacher_hidden"),
    ({"labels": "float"}, "int64"),
    ({"weights": "short"}, "must be \\[28\\]"),
    ({"lm_head_weight": "wide"}, "lm_head_weight"),
]


@pytest.mark.parametrize("override,message", BAD_INPUTS)
def test_bad_inputs_are_rejected_with_a_clear_message(override, message):
    hidden, weight, labels, weights, teacher = make_case()
    args = {"lm_head_weight": weight, "labels": labels, "weights": weights, "block_size": 4, "normalizer": 1.0}
    replacements = {
        "ok": teacher,
        "short": None,
        "float": labels.double(),
        "wide": torch.zeros(37, 17, dtype=weight.dtype),
    }
    for key, value in override.items():
        if value == "short":
            value = (teacher if key == "teacher_hidden" else weights)[:-1]
        elif isinstance(value, str):
            value = replacements[value]
        args[key] = value
    with pytest.raises(LossInputError, match=message):
        dflash_loss(hidden, args.pop("lm_head_weight"), args.pop("labels"), args.pop("weights"), **args)


def test_compile_friendly_onehot_equals_scatter():
    """The kernels torch.compile gets (one-hot by comparison) compute the same gradient as the eager scatter."""
    gen = torch.Generator().manual_seed(8)
    logits, teacher = torch.randn(6, 11, generator=gen), torch.randn(6, 11, generator=gen)
    labels = torch.randint(0, 11, (6,), generator=gen)
    lse, lse_t = torch.logsumexp(logits, -1), torch.logsumexp(logits / 2.0, -1)
    coef = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.1, 0.0])
    for args in ((None, None, None), (teacher, lse_t, coef * 0.3)):
        scatter = _logit_grad(logits, labels, lse, coef, *args, 2.0)
        compare = _logit_grad(logits, labels, lse, coef, *args, 2.0, onehot_by_compare=True)
        torch.testing.assert_close(compare[0], scatter[0])
    assert torch.all(scatter[0][coef == 0] == 0) and torch.isfinite(scatter[0]).all()


def _eager_fused_ce(calls: list, logits_seen: list | None = None):
    """A fused-CE stand-in with the Triton kernel's contract (unscaled softmax - onehot), recording its calls
    (want_grad) and, given `logits_seen`, the chunks of logits it was handed."""

    def fused_ce(logits, labels, *, want_grad=True):
        calls.append(want_grad)
        if logits_seen is not None:
            logits_seen.append(logits)
        lse = torch.logsumexp(logits, -1)
        grad = torch.softmax(logits, -1) - torch.nn.functional.one_hot(labels, logits.shape[1]).to(logits.dtype)
        return (grad if want_grad else None), lse, lse - logits.gather(1, labels[:, None])[:, 0], logits.argmax(-1)

    return fused_ce


def test_slot_zero_is_never_computed_and_gets_no_gradient():
    """The anchor slot's logits are never formed: the kernels see the hidden rows of slots 1..B-1 only, in order;
    slot 0's gradient is exactly 0 and its `correct` False."""
    hidden, weight, labels, weights, _ = make_case()
    seen: list[torch.Tensor] = []
    kernels = ChunkKernels(fused_ce=_eager_fused_ce([], seen))
    ours = hidden.clone().requires_grad_(True)
    result = dflash_loss(ours, weight, labels, weights, block_size=4, normalizer=1.0, chunk_size=8, kernels=kernels)
    result.loss.backward()
    supervised = hidden.view(7, 4, -1)[:, 1:].reshape(21, -1)
    torch.testing.assert_close(torch.cat(seen), supervised @ weight.T, rtol=1e-12, atol=1e-12)
    assert torch.all(ours.grad.view(7, 4, -1)[:, 0] == 0) and ours.grad.view(7, 4, -1)[:, 1:].abs().sum() > 0
    assert not result.correct.view(7, 4)[:, 0].any()


@pytest.mark.parametrize("terms", list(TERMS))
def test_computing_the_anchor_slot_changes_nothing_but_the_work(terms, monkeypatch):
    """loss.SKIP_ANCHOR_SLOT off (the bench's `triton-s8` variant) computes slot 0's logits too: the same loss, sums,
    gradient and `correct` on the supervised slots."""
    from trainer.training import loss as loss_module

    hidden, weight, labels, weights, teacher = make_case()
    kwargs = dict(block_size=4, normalizer=float(weights.sum()) * 1.5, chunk_size=8, **TERMS[terms])
    if "kl_weight" in kwargs:
        kwargs["teacher_hidden"] = teacher
    results = {}
    for skip in (True, False):
        monkeypatch.setattr(loss_module, "SKIP_ANCHOR_SLOT", skip)
        ours = hidden.clone().requires_grad_(True)
        result = dflash_loss(ours, weight, labels, weights, **kwargs)
        result.loss.backward()
        results[skip] = result, ours.grad
    (skipped, grad_skipped), (computed, grad_computed) = results[True], results[False]
    for name in ("loss", "ce_sum", "kl_sum", "cap_sum", "weight_sum", "num_blocks"):
        torch.testing.assert_close(getattr(skipped, name), getattr(computed, name), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_skipped, grad_computed, rtol=1e-12, atol=1e-14)
    supervised = torch.arange(28) % 4 > 0
    assert skipped.correct[supervised].tolist() == computed.correct[supervised].tolist()


@pytest.mark.parametrize(
    "blocks, chunk_size, expected",
    [(9, 16, [9, 9, 9]), (7, 8, [6, 6, 6, 3]), (7, 20, [12, 9]), (7, 28, [21])],
)
def test_rows_are_split_into_equal_chunks_under_the_chunk_size(blocks, chunk_size, expected):
    """Blocks of 4 rows: at most chunk_size rows (rounded down to whole blocks) per chunk, as few chunks as that
    allows, as equal as whole blocks make them: 36 rows under 16 are 3 chunks of 3 blocks, not 4 + 4 + 1. The
    kernels see 3 rows per block: slot 0 (the anchor) is never computed."""
    hidden, weight, labels, weights, _ = make_case(blocks=blocks)
    seen: list[torch.Tensor] = []
    kernels = ChunkKernels(fused_ce=_eager_fused_ce([], seen))
    dflash_loss(hidden, weight, labels, weights, block_size=4, normalizer=1.0, chunk_size=chunk_size, kernels=kernels)
    assert [logits.shape[0] for logits in seen] == expected


@pytest.mark.parametrize("terms", list(TERMS))
def test_fused_ce_contract_gives_the_reference_and_soft_labels_never_use_it(terms):
    """Kernels with fused_ce: CE and CE+CAP go through it (coefficients applied after GEMM 2); with soft labels
    the two-kernel path runs instead, since the fused kernel has no KL term. Checked with an eager stand-in, so
    this needs no triton (tests/trainer/test_loss_triton.py runs the real kernel)."""
    hidden, weight, labels, weights, teacher = make_case()
    kwargs = dict(block_size=4, normalizer=float(weights.sum()) * 1.5, **TERMS[terms])
    if "kl_weight" in kwargs:
        kwargs["teacher_hidden"] = teacher
    calls: list = []
    ours = hidden.clone().requires_grad_(True)
    result = dflash_loss(
        ours,
        weight,
        labels,
        weights,
        chunk_size=8,
        kernels=ChunkKernels(fused_ce=_eager_fused_ce(calls), kind="fused-stand-in"),
        **kwargs,
    )
    result.loss.backward()
    ref_hidden = hidden.clone().requires_grad_(True)
    dense_reference(ref_hidden, weight, labels, weights, **kwargs).backward()
    torch.testing.assert_close(ours.grad, ref_hidden.grad, rtol=1e-6, atol=1e-9)
    assert calls == ([] if "kl" in terms else [True] * 4)  # 28 rows, chunks of 8: 4 chunks
    with torch.no_grad():
        dflash_loss(
            hidden,
            weight,
            labels,
            weights,
            chunk_size=8,
            kernels=ChunkKernels(fused_ce=_eager_fused_ce(calls)),
            **kwargs,
        )
    assert calls[4:] == ([] if "kl" in terms else [False] * 4)  # eval: no gradient written


def _eager_soft_label(calls: list) -> SoftLabelKernels:
    """Soft-label stand-ins with the Triton kernels' contract (g = (p - y) + ratio (p_T - q_T), unscaled; g
    written into ``out``), recording their calls and the ratios they were given."""

    def statistics(x, t, labels, temperature):
        lse = torch.logsumexp(x, -1)
        log_p_t, log_q_t = torch.log_softmax(x / temperature, -1), torch.log_softmax(t / temperature, -1)
        kl = (log_q_t.exp() * (log_q_t - log_p_t)).sum(-1)
        return lse, lse - x.gather(1, labels[:, None])[:, 0], kl, x.argmax(-1)

    def gradient(x, t, labels, ratio, temperature, out):
        onehot = torch.nn.functional.one_hot(labels, x.shape[1]).to(x.dtype)
        grad = (
            torch.softmax(x, -1)
            - onehot
            + ratio * (torch.softmax(x / temperature, -1) - torch.softmax(t / temperature, -1))
        )
        return out.copy_(grad) if out is not None else grad

    def fused(x, t, labels, *, temperature, kl_ratio, want_grad, out=None):
        calls.append(("fused", want_grad, kl_ratio))
        stats = statistics(x, t, labels, temperature)  # before out (= t) is overwritten
        return (gradient(x, t, labels, kl_ratio, temperature, out) if want_grad else None), *stats

    def stats(x, t, labels, *, temperature):
        calls.append(("stats",))
        return "row state", *statistics(x, t, labels, temperature)

    def grad(x, t, labels, row_state, kl_ratio, *, temperature, out=None):
        assert row_state == "row state" and kl_ratio.shape == labels.shape and kl_ratio.dtype == x.dtype
        calls.append(("grad", kl_ratio.clone()))
        return gradient(x, t, labels, kl_ratio[:, None], temperature, out)

    return SoftLabelKernels(fused=fused, stats=stats, grad=grad)


@pytest.mark.parametrize("terms", list(TERMS))
def test_soft_label_contract_gives_the_reference(terms):
    """Kernels with soft_label: CE+KL runs ``fused`` once per chunk with the constant ratio kl_weight * T, and
    CE+KL+CAP ``stats`` then ``grad`` with a per-row ratio; eval runs ``stats`` only; CE and CE+CAP never call
    them. float64 stand-ins (no triton): the algebra of the unscaled g and the row scale after GEMM 2 must give
    the dense reference exactly. tests/trainer/test_loss_triton.py runs the real kernels."""
    hidden, weight, labels, weights, teacher = make_case()
    kwargs = dict(block_size=4, normalizer=float(weights.sum()) * 1.5, **TERMS[terms])
    if "kl_weight" in kwargs:
        kwargs["teacher_hidden"] = teacher
    calls: list = []
    kernels = ChunkKernels(soft_label=_eager_soft_label(calls), kind="soft-label-stand-in")
    ours = hidden.clone().requires_grad_(True)
    result = dflash_loss(ours, weight, labels, weights, chunk_size=8, kernels=kernels, **kwargs)
    result.loss.backward()
    ref_hidden = hidden.clone().requires_grad_(True)
    ref_loss = dense_reference(ref_hidden, weight, labels, weights, **kwargs)
    ref_loss.backward()
    torch.testing.assert_close(result.loss, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.grad, ref_hidden.grad, rtol=1e-9, atol=1e-12)
    eager = dflash_loss(hidden, weight, labels, weights, chunk_size=8, **kwargs)
    torch.testing.assert_close(result.kl_sum, eager.kl_sum, rtol=1e-12, atol=1e-14)
    assert result.correct.tolist() == eager.correct.tolist()
    kinds = [call[0] for call in calls]
    if "kl" not in terms:
        assert kinds == []
    elif "cap" not in terms:  # 28 rows, chunks of 8: 4 chunks
        assert calls == [("fused", True, kwargs["kl_weight"] * kwargs["kl_temperature"])] * 4
    else:
        assert kinds == ["stats", "grad"] * 4
        ratios = torch.cat([call[1] for call in calls if call[0] == "grad"])
        valid = (weights > 0).view(7, 4)[:, 1:].reshape(-1)  # the kernels see slots 1..3 of each block only
        assert ratios.shape == (21,) and torch.all(ratios[~valid] == 0)
        # CAP's coefficient adds to the CE one, so the KL/CE ratio drops below kl_weight * T where CAP acts
        constant = kwargs["kl_weight"] * kwargs["kl_temperature"]
        assert torch.all(ratios[valid] > 0) and torch.all(ratios[valid] < constant)
    calls.clear()
    with torch.no_grad():
        evaluated = dflash_loss(hidden, weight, labels, weights, chunk_size=8, kernels=kernels, **kwargs)
    torch.testing.assert_close(evaluated.loss, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    assert [call[0] for call in calls] == ([] if "kl" not in terms else ["stats"] * 4)  # eval: no gradient


def test_make_chunk_kernels_kinds():
    assert make_chunk_kernels("eager").fused_ce is None and make_chunk_kernels("compiled").kind == "compiled"
    with pytest.raises(ValueError, match="unknown loss kernels 'turbo'"):
        make_chunk_kernels("turbo")


def test_the_trainer_imports_without_importing_triton():
    """triton is imported at the first fused-kernel call only: the CPU CI's torch wheel does not bring it."""
    repo = Path(__file__).resolve().parents[2]
    code = "import sys, trainer.training.loss, trainer.kernels.loss_triton, trainer.training.step; print('triton' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"
