"""The fused Triton kernels (CE: trainer/kernels/loss_triton.py, CE+KL: trainer/kernels/loss_triton_kl.py) against the eager
loss and a float64 reference, on CPU via Triton's interpreter.

The kernel runs in ONE child process (tests/trainer/triton_interp_worker.py, TRITON_INTERPRET=1 there only:
the variable changes how every Triton kernel of a process runs, so it must not leak into this one). This
process builds the inputs, the child returns the kernel's outputs, and the comparisons against the eager path
(and plain torch) happen here, in float32. Tile sizes are tiny (16, 32) so that V=37 spans several tiles with
a partial last one, and a persistent config (programs_per_sm=1: 2 "SMs" under the interpreter) makes programs
loop over rows. The CE+KL kernel runs at T = 2 and 3 (integer powers instead of an exp), 1 and 0.7 (its own
exp), fused in one launch and split into stats + grad (the CAP path); the loss runs CE+KL (T = 2) and
CE+KL+CAP (T = 0.7) against float64. `make test` installs triton (dev extra); elsewhere the module is skipped.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.test_loss import TERMS, make_case
from tests.trainer.triton_interp import interpret_cases
from trainer.training.loss import dflash_loss

pytest.importorskip("triton", reason="the triton package is not installed (`make test` installs it: dev extra)")

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("triton_interp_worker.py")
TILED, PERSISTENT = "16:4:0", "16:2:1"  # V=37: 3 tiles of 16, the last one 5 wide


def _logits(rows: int, vocab: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    top = logits.abs().max() * 2
    logits[0, [3, 20]] = top  # a tie across tiles: the first index wins
    logits[1, [17, 18]] = top  # a tie inside a tile
    logits[2, vocab - 1] = top  # the maximum in the partial last tile
    labels[3] = vocab - 1  # a label in the partial last tile
    return logits, labels


KERNEL_CASES = {
    "tiled": dict(shape=(9, 37), scale=3.0, config=TILED),
    "persistent": dict(shape=(9, 37), scale=3.0, config=PERSISTENT),
    "one-tile": dict(shape=(5, 37), scale=3.0, config="4096:8:0"),  # BLOCK_V clamps to 64
    "large-logits": dict(shape=(6, 37), scale=60.0, config=TILED),  # exp without the max shift overflows
    "exact-tiles": dict(shape=(4, 64), scale=3.0, config="32:4:0"),
    "bf16": dict(shape=(9, 37), scale=3.0, config=TILED, dtype=torch.bfloat16),
    "no-grad": dict(shape=(9, 37), scale=3.0, config=PERSISTENT, want_grad=False),
}

TOPK_CASES = {  # DFlash2's running top-k in the CE kernel: k, logits rounded to integers (ties everywhere)
    "topk16-tiled-ties": dict(shape=(9, 37), scale=3.0, config=TILED, topk=16, ties=True),
    "topk5-persistent-ties": dict(shape=(9, 37), scale=3.0, config=PERSISTENT, topk=5, ties=True),
    "topk3-one-tile": dict(shape=(5, 37), scale=3.0, config="4096:8:0", topk=3),
    "topk1-exact-tiles": dict(shape=(4, 64), scale=3.0, config="32:4:0", topk=1),
    "topk37-all": dict(shape=(4, 37), scale=3.0, config=TILED, topk=37, ties=True),
    "topk8-bf16-no-grad": dict(shape=(9, 37), scale=3.0, config=TILED, topk=8, dtype=torch.bfloat16, want_grad=False),
}


def pairwise(terms: tuple[str, str]) -> list[tuple[str, int | None, str]]:
    """(terms, chunk_size, config) with every pair of values once: both terms with each chunking, both configs with
    each chunking and with each terms. Six cases where the product has twelve: each interprets the loss forward,
    backward and evaluation (~0.3 CPU-s for plain terms, ~0.8 with KL); the configs' own paths are the kernel cases'."""
    first, second = terms
    return [
        (first, None, TILED),
        (first, 8, PERSISTENT),
        (first, 13, TILED),
        (second, None, PERSISTENT),
        (second, 8, TILED),
        (second, 13, PERSISTENT),
    ]


LOSS_CASES = {  # (terms, chunk_size, config): 28 rows in blocks of 4; chunks 8 and 13 -> 12 leave a short last one
    f"{terms}-chunk{chunk}-{config}": (terms, chunk, config) for terms, chunk, config in pairwise(("ce", "ce+cap"))
}


def _loss_inputs(terms: str, chunk, hidden_scale: float = 1.0, head_dtype: torch.dtype = torch.float32, topk: int = 0):
    """make_case's inputs (V=37, zero-weight rows, -100 labels, a padded block) in float32 (the head in
    ``head_dtype``: the GEMM and logits dtype), hidden states times ``hidden_scale`` (logits ~N(0, scale^2));
    topk > 0: DFlash2's candidates too."""
    hidden, weight, labels, weights, teacher = make_case(dtype=torch.float32)
    kwargs = dict(block_size=4, normalizer=float(weights.sum()) * 1.5, chunk_size=chunk, **TERMS[terms])
    if topk:
        kwargs["topk"] = topk
    if "kl_weight" in kwargs:
        kwargs["teacher_hidden"] = teacher * hidden_scale
    return dict(
        hidden=hidden * hidden_scale, weight=weight.to(head_dtype), labels=labels, weights=weights, kwargs=kwargs
    )


KL_KERNEL_CASES = {  # op, shape, scale, config, temperature, dtype
    "kl-tiled-t2": dict(op="fused_ce_kl", shape=(9, 37), scale=3.0, config=TILED, temperature=2.0),
    "kl-persistent-t0.7": dict(op="fused_ce_kl", shape=(9, 37), scale=3.0, config=PERSISTENT, temperature=0.7),
    "kl-one-tile-t1": dict(op="fused_ce_kl", shape=(5, 37), scale=3.0, config="4096:8:0", temperature=1.0),
    "kl-exact-tiles-t3": dict(op="fused_ce_kl", shape=(4, 64), scale=3.0, config="32:4:0", temperature=3.0),
    "kl-large-logits-t2": dict(op="fused_ce_kl", shape=(6, 37), scale=60.0, config=TILED, temperature=2.0),
    "kl-large-logits-t0.7": dict(op="fused_ce_kl", shape=(6, 37), scale=60.0, config=PERSISTENT, temperature=0.7),
    "kl-bf16-t2": dict(op="fused_ce_kl", shape=(9, 37), scale=3.0, config=TILED, temperature=2.0, dtype=torch.bfloat16),
    "kl-no-grad": dict(op="fused_ce_kl", shape=(9, 37), scale=3.0, config=PERSISTENT, temperature=2.0, want_grad=False),
    "kl-split-t2": dict(op="ce_kl_split", shape=(9, 37), scale=3.0, config=TILED, temperature=2.0),
    "kl-split-t0.7": dict(op="ce_kl_split", shape=(9, 37), scale=3.0, config=PERSISTENT, temperature=0.7),
    "kl-split-large-bf16": dict(
        op="ce_kl_split", shape=(6, 37), scale=60.0, config=TILED, temperature=2.0, dtype=torch.bfloat16
    ),
}
KL_RATIO = 0.15 * 2.0  # the seed's kl_weight * T


def _kl_kernel_case(name: str, spec: dict) -> dict:
    logits, labels = _logits(*spec["shape"], spec["scale"], seed=len(name))
    gen = torch.Generator().manual_seed(len(name) + 100)
    rows, vocab = spec["shape"]
    teacher = torch.randn(rows, vocab, generator=gen) * spec["scale"]
    teacher[:, 1] += spec["scale"]  # a teacher maximum in the first tile, the student's elsewhere
    if spec["op"] == "ce_kl_split":  # CAP makes the ratio differ per row; 0 on a weight-0 row
        ratio = torch.rand(rows, generator=gen) * KL_RATIO * 2
        ratio[1] = 0.0
    else:
        ratio = KL_RATIO
    dtype = spec.get("dtype", torch.float32)
    return dict(
        op=spec["op"],
        logits=logits.to(dtype),
        teacher=teacher.to(dtype),
        labels=labels,
        ratio=ratio,
        temperature=spec["temperature"],
        config=spec["config"],
        want_grad=spec.get("want_grad", True),
    )


LOSS_KL_CASES = {  # (terms, chunk_size, config, hidden_scale, head dtype); 28 rows in blocks of 4
    **{
        f"{terms}-chunk{chunk}-{config}": (terms, chunk, config, 1.0, torch.float32)
        for terms, chunk, config in pairwise(("ce+kl", "ce+kl+cap"))
    },
    "ce+kl-large-logits": ("ce+kl", 8, TILED, 30.0, torch.float32),
    "ce+kl+cap-large-logits": ("ce+kl+cap", 13, PERSISTENT, 30.0, torch.float32),
}
LOSS_KL_BF16_CASES = {  # a bf16 head: bf16 logits, as on the GPU; compared with the eager path on the same logits
    "ce+kl-bf16": ("ce+kl", 8, TILED),
    "ce+kl+cap-bf16": ("ce+kl+cap", 13, PERSISTENT),
}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case's Triton outputs, from one interpreter subprocess."""
    cases = {}
    for name, spec in KERNEL_CASES.items():
        logits, labels = _logits(*spec["shape"], spec["scale"], seed=len(name))
        cases[name] = dict(
            op="fused_ce",
            logits=logits.to(spec.get("dtype", torch.float32)),
            labels=labels,
            config=spec["config"],
            want_grad=spec.get("want_grad", True),
        )
    for name, spec in TOPK_CASES.items():
        logits, labels = _logits(*spec["shape"], spec["scale"], seed=len(name))
        if spec.get("ties"):
            logits = logits.round()
            logits[1, :] = 1.0  # one row of a single value: the k lowest columns, in column order
        cases[name] = dict(
            op="fused_ce_topk",
            logits=logits.to(spec.get("dtype", torch.float32)),
            labels=labels,
            config=spec["config"],
            topk=spec["topk"],
            want_grad=spec.get("want_grad", True),
        )
    for chunk in (None, 13):  # DFlash2's candidates through dflash_loss(topk=...) with the kernel's running top-k
        cases[f"loss-topk5-chunk{chunk}"] = dict(op="loss", config=TILED, **_loss_inputs("ce", chunk, topk=5))
    cases["bad-label"] = dict(
        op="fused_ce",
        logits=cases["tiled"]["logits"],
        config=TILED,
        want_grad=True,
        labels=torch.where(torch.arange(9) == 4, 37, cases["tiled"]["labels"]),
    )
    for name, (terms, chunk, config) in LOSS_CASES.items():
        cases[name] = dict(op="loss", config=config, **_loss_inputs(terms, chunk))
    for name, spec in KL_KERNEL_CASES.items():
        cases[name] = _kl_kernel_case(name, spec)
    bad = cases["kl-tiled-t2"]
    cases["kl-bad-label"] = {**bad, "labels": torch.where(torch.arange(9) == 4, 37, bad["labels"])}
    for name, (terms, chunk, config, scale, head_dtype) in LOSS_KL_CASES.items():
        cases[name] = dict(op="loss", config=config, **_loss_inputs(terms, chunk, scale, head_dtype))
    for name, (terms, chunk, config) in LOSS_KL_BF16_CASES.items():
        cases[name] = dict(op="loss", config=config, **_loss_inputs(terms, chunk, head_dtype=torch.bfloat16))
    return interpret_cases(WORKER, cases, tmp_path_factory.mktemp("triton-interp"))


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_torch(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    x, labels = case["logits"].float(), case["labels"]
    lse = torch.logsumexp(x, -1)
    # fp32 statistics: the online max/sum-exp differs from torch's by summation order, a few ulps of the result
    torch.testing.assert_close(got["lse"], lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got["ce"], lse - x.gather(1, labels[:, None])[:, 0], rtol=2e-6, atol=2e-6)
    assert got["argmax"].dtype == torch.int64 and got["argmax"].tolist() == case["logits"].argmax(-1).tolist()
    assert got["argmax"][:3].tolist() == [3, 17, x.shape[1] - 1]
    if not case["want_grad"]:
        assert got["grad"] is None
        return
    expected = torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, x.shape[1])
    assert got["grad"].dtype == case["logits"].dtype
    if case["logits"].dtype == torch.bfloat16:  # fp32 math, one rounding to bf16: within one bf16 ulp
        torch.testing.assert_close(got["grad"].float(), expected, rtol=2**-7, atol=1e-6)
    else:
        torch.testing.assert_close(got["grad"], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(TOPK_CASES))
def test_kernel_topk_matches_a_stable_sort(interpreted, name):
    """The running top-k: values and ids as a stable descending sort gives them (equal values: the lower column
    first, and the lower columns fill the last places), whatever the tiling; every other output unchanged."""
    case, got = interpreted["cases"][name], interpreted["out"][name]
    k, x = case["topk"], case["logits"].float()
    values, ids = torch.sort(x, dim=1, descending=True, stable=True)
    assert got["ids"].dtype == torch.int64 and got["values"].dtype == torch.float32
    assert torch.equal(got["ids"], ids[:, :k]), (got["ids"], ids[:, :k])
    assert torch.equal(got["values"], values[:, :k])
    torch.testing.assert_close(got["values"], x.topk(k, dim=1).values, rtol=0, atol=0)  # the same values as topk
    if TOPK_CASES[name].get("ties"):  # the case has ties at the k-th place, so the tie rule is exercised
        assert (x[1] == 1.0).all() and got["ids"][1].tolist() == list(range(k))
    plain = got["plain"]
    for key, value in zip(("grad", "lse", "ce", "argmax"), plain):
        assert (value is None and got[key] is None) or torch.equal(got[key], value), key


@pytest.mark.parametrize("chunk", [None, 13])
def test_loss_candidates_from_the_kernel_match_the_eager_topk(interpreted, chunk):
    """dflash_loss(topk=5) on the fused kernel (running top-k) and on eager torch.topk: the same candidates (the
    label put last where missing), their logits, places and hits; the loss as without candidates."""
    name = f"loss-topk5-chunk{chunk}"
    case, got = interpreted["cases"][name], interpreted["out"][name]
    eager = dflash_loss(case["hidden"], case["weight"], case["labels"], case["weights"], **case["kwargs"])
    assert eager.candidates is not None and eager.label_found is not None and eager.label_found.any()
    assert not eager.label_found[case["weights"] > 0].all()  # some rows have their label put last
    assert torch.equal(got["candidates"], eager.candidates)
    torch.testing.assert_close(got["candidate_logits"], eager.candidate_logits, rtol=0, atol=0)
    assert torch.equal(got["label_place"], eager.label_place) and torch.equal(got["label_found"], eager.label_found)
    torch.testing.assert_close(got["loss"], eager.loss, rtol=1e-5, atol=1e-6)


def test_out_of_range_label_gives_nan_ce_not_a_wild_read(interpreted):
    got, ok = interpreted["out"]["bad-label"], interpreted["out"]["tiled"]
    assert math.isnan(got["ce"][4].item()) and not got["ce"][torch.arange(9) != 4].isnan().any()
    torch.testing.assert_close(got["lse"], ok["lse"])


@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_loss_value_and_gradient_match_the_eager_path(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    hidden = case["hidden"].clone().requires_grad_(True)
    eager = dflash_loss(hidden, case["weight"], case["labels"], case["weights"], **case["kwargs"])
    eager.loss.backward()
    # fp32 throughout; the fused path scales (P - Y) W by the row coefficient after the GEMM, eager before it
    torch.testing.assert_close(got["loss"], eager.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["eval_loss"], eager.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["grad"], hidden.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["ce_sum"], eager.ce_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["cap_sum"], eager.cap_sum, rtol=1e-5, atol=1e-6)
    assert got["correct"].tolist() == eager.correct.tolist()
    zero = case["weights"] == 0
    assert zero.any() and torch.all(got["grad"][zero] == 0)  # zero-weight rows: computed, then scaled by 0
    if "cap" in name:
        assert got["cap_sum"].item() > 0


def _kl_reference(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float, ratio):
    """float64 (lse, ce, kl, g) of the exact input values, the obvious way."""
    x, t = logits.double(), teacher.double()
    lse = torch.logsumexp(x, -1)
    log_p_t, log_q_t = torch.log_softmax(x / temperature, -1), torch.log_softmax(t / temperature, -1)
    kl = (log_q_t.exp() * (log_q_t - log_p_t)).sum(-1)
    ratio = ratio.double()[:, None] if isinstance(ratio, torch.Tensor) else ratio
    grad = (
        torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, x.shape[1]) + ratio * (log_p_t.exp() - log_q_t.exp())
    )
    return lse, lse - x.gather(1, labels[:, None])[:, 0], kl, grad


@pytest.mark.parametrize("name", list(KL_KERNEL_CASES))
def test_kl_kernel_matches_float64(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    lse, ce, kl, grad = _kl_reference(
        case["logits"], case["teacher"], case["labels"], case["temperature"], case["ratio"]
    )
    # fp32 statistics: summation order and fp32 rounding against float64, a few ulps of each result
    torch.testing.assert_close(got["lse"].double(), lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got["ce"].double(), ce, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got["kl"].double(), kl, rtol=2e-6, atol=2e-6)
    assert kl.min() > 0.1  # the teacher differs from the student: a KL of 0 would not test the cross term
    assert got["argmax"].dtype == torch.int64 and got["argmax"].tolist() == case["logits"].argmax(-1).tolist()
    assert got["argmax"][:3].tolist() == [3, 17, case["logits"].shape[1] - 1]
    if not case["want_grad"]:
        assert got["grad"] is None
        return
    assert got["grad"].dtype == case["logits"].dtype
    if case["logits"].dtype == torch.bfloat16:  # fp32 math, one rounding to bf16: within one bf16 ulp
        torch.testing.assert_close(got["grad"].double(), grad, rtol=2**-7, atol=1e-6)
    else:
        torch.testing.assert_close(got["grad"].double(), grad, rtol=1e-5, atol=3e-7)
    if case["op"] == "fused_ce_kl":  # written over the teacher logits: the same g, bit for bit
        assert torch.equal(got["in_place_grad"], got["grad"])
        assert torch.equal(got["overwritten_teacher"], got["grad"])


def test_kl_kernel_out_of_range_label_gives_nan_ce(interpreted):
    got, ok = interpreted["out"]["kl-bad-label"], interpreted["out"]["kl-tiled-t2"]
    assert math.isnan(got["ce"][4].item()) and not got["ce"][torch.arange(9) != 4].isnan().any()
    torch.testing.assert_close(got["kl"], ok["kl"])
    torch.testing.assert_close(got["lse"], ok["lse"])


def _float64_eager(case: dict):
    """The eager loss on float64 copies of the case's exact input values: value, sums, gradient."""
    kwargs = dict(case["kwargs"])
    if "teacher_hidden" in kwargs:
        kwargs["teacher_hidden"] = kwargs["teacher_hidden"].double()
    hidden = case["hidden"].double().requires_grad_(True)
    result = dflash_loss(hidden, case["weight"].double(), case["labels"], case["weights"].double(), **kwargs)
    result.loss.backward()
    return result, hidden.grad


@pytest.mark.parametrize("name", list(LOSS_KL_CASES))
def test_soft_label_loss_matches_float64(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    ref, ref_grad = _float64_eager(case)
    for key, value in (
        ("loss", ref.loss.detach()),
        ("eval_loss", ref.loss.detach()),
        ("ce_sum", ref.ce_sum),
        ("kl_sum", ref.kl_sum),
        ("eval_kl_sum", ref.kl_sum),
        ("cap_sum", ref.cap_sum),
    ):
        torch.testing.assert_close(got[key].double(), value, rtol=1e-5, atol=1e-6, msg=key)
    scale = ref_grad.abs().max()
    torch.testing.assert_close(got["grad"].double(), ref_grad, rtol=1e-5, atol=1e-6 * scale)
    assert got["correct"].tolist() == ref.correct.tolist()
    zero = case["weights"] == 0
    assert zero.any() and torch.all(got["grad"][zero] == 0)  # zero-weight rows: computed, then scaled by 0
    assert got["kl_sum"].item() > 0
    if "cap" in name:
        assert got["cap_sum"].item() > 0


@pytest.mark.parametrize("name", list(LOSS_KL_BF16_CASES))
def test_soft_label_loss_with_a_bf16_head_matches_the_eager_path(interpreted, name):
    """bf16 logits from the same GEMM: the fp32 statistics agree closely; the gradient differs by where it is
    rounded to bf16 (eager: the scaled d loss/d logits; fused: the unscaled g before the row scale)."""
    case, got = interpreted["cases"][name], interpreted["out"][name]
    hidden = case["hidden"].clone().requires_grad_(True)
    eager = dflash_loss(hidden, case["weight"], case["labels"], case["weights"], **case["kwargs"])
    eager.loss.backward()
    for key, value in (
        ("loss", eager.loss.detach()),
        ("ce_sum", eager.ce_sum),
        ("kl_sum", eager.kl_sum),
        ("cap_sum", eager.cap_sum),
    ):
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert got["correct"].tolist() == eager.correct.tolist()
    relative = (got["grad"] - hidden.grad).norm() / hidden.grad.norm()
    assert relative < 1e-2, relative


def test_loss_gemm_bench_runs_soft_labels_on_the_triton_kernels():
    """bench/loss_gemm.py (what the H200 run uses) end to end at a tiny shape, triton interpreted, --profile
    included: one row per term for the triton kernels (the KL config labels the soft-label rows), each matching
    the eager gradient, and the summary table (best row per term and kernels) is the last thing printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    command = [
        sys.executable,
        str(REPO / "bench" / "loss_gemm.py"),
        "--device",
        "cpu",
        "--rows",
        "32",
        "--hidden",
        "16",
        "--vocab",
        "37",
        "--block-size",
        "4",
        "--chunks",
        "12",
        "--kernels",
        "eager,triton",
        "--terms",
        "ce,ce-kl,ce-kl-cap",
        "--triton-configs",
        TILED,
        "--kl-triton-configs",
        PERSISTENT,
        "--repeats",
        "1",
        "--profile",
    ]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-6000:]
    lines = out.stdout.strip().splitlines()
    rows = [
        line.split()
        for line in lines
        if line.split()[:2] in (["12", f"triton[{TILED}]"], ["12", f"triton[{PERSISTENT}]"])
    ]
    assert [row[2] for row in rows] == ["ce", "ce-kl", "ce-kl-cap"]
    assert all(float(row[-2]) < 1e-5 for row in rows), rows  # gradient vs the eager kernels (relative L2)
    summary = lines[-8:]
    assert summary[0].startswith("summary") and summary[1].split()[:2] == ["terms", "kernels"]
    assert [line.split()[:2] for line in summary[2:]] == [
        ["ce", "eager"],
        ["ce", f"triton[{TILED}]"],
        ["ce-kl", "eager"],
        ["ce-kl", f"triton[{PERSISTENT}]"],
        ["ce-kl-cap", "eager"],
        ["ce-kl-cap", f"triton[{PERSISTENT}]"],
    ]


SM90_RESOURCES = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trainer.kernels import loss_triton_kl

kernel = loss_triton_kl._kernel()
config = loss_triton_kl.DEFAULT_CONFIG
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
names = ["x_ptr", "t_ptr", "labels_ptr", "grad_ptr", "ratio_ptr", "state_ptr", "lse_ptr", "ce_ptr", "kl_ptr",
         "argmax_ptr", "n_rows", "x_stride", "t_stride", "grad_stride", "ratio", "inv_temperature"]
types = ["*bf16", "*bf16", "*i64", "*bf16", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*i64",
         "i32", "i32", "i32", "i32", "fp32", "fp32"]
aligned = [i for i, name in enumerate(names) if name.endswith(("_ptr", "_stride"))]  # as the JIT specialises
usage = {}
for mode, (stats, grad, per_row) in {"fused": (True, True, False), "stats": (True, False, False),
                                     "grad": (False, True, True)}.items():
    constexprs = dict(N_COLS=151936, BLOCK_V=config.block_v, T_POWER=2, STATS=stats, GRAD=grad, RATIO_PER_ROW=per_row)
    signature = {**dict(zip(names, types)), **{name: "constexpr" for name in constexprs}}
    source = ASTSource(kernel, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    usage[mode] = {key: int(value) for key, value in re.findall(r"(REG|STACK):(\\d+)", dump)}
print(json.dumps(usage))
"""


def test_kl_kernel_default_config_compiles_for_sm90_without_spills(tmp_path):
    """The kernel compiled for an H100/H200 (sm_90) offline, no GPU needed: all three pass sets build, and the
    default config (2048:4:0, the fastest of six on the H200: 168 registers, 3 programs of 4 warps per SM)
    spills nothing to the stack. Needs the triton wheel's CUDA tools."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton has no bundled cuobjdump (CUDA backend tools)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", SM90_RESOURCES], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-6000:]
    usage = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(usage) == {"fused", "stats", "grad"}
    for mode, resources in usage.items():
        assert resources["STACK"] == 0 and 0 < resources["REG"] <= 192, (mode, resources)


def test_the_topk_kernel_has_its_own_config(monkeypatch):
    """DFlash2's CE kernel with the running top-k: TOPK_CONFIG (2048:4, bench/results/kernels.md 2026-12-04 "DFlash2's convolutions rewritten for Inductor") unless
    $DFLASH_CE_TOPK_TRITON says otherwise; an explicit config for the CE kernel, or one for the top-k kernel, wins."""
    from trainer.kernels import loss_triton
    from trainer.training.loss import make_chunk_kernels

    def topk_config(**kwargs) -> loss_triton.CEKernelConfig:
        fused_ce_topk = make_chunk_kernels("triton", **kwargs).fused_ce_topk
        assert fused_ce_topk is not None
        return fused_ce_topk.keywords["config"]  # type: ignore[attr-defined]

    monkeypatch.delenv(loss_triton.TOPK_ENV_CONFIG, raising=False)
    monkeypatch.setenv(loss_triton.ENV_CONFIG, "8192:16")  # the plain CE kernel's setting is not the top-k's
    assert topk_config() == loss_triton.TOPK_CONFIG == loss_triton.CEKernelConfig(2048, 4, 0)
    monkeypatch.setenv(loss_triton.TOPK_ENV_CONFIG, "1024:1")
    assert topk_config() == loss_triton.CEKernelConfig(1024, 1, 0)
    assert topk_config(triton_config="512:2") == loss_triton.CEKernelConfig(512, 2, 0)
    assert topk_config(triton_config="512:2", topk_triton_config="256:1:2") == loss_triton.CEKernelConfig(256, 1, 2)
