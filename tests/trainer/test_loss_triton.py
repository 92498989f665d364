"""The fused Triton CE kernel (trainer/loss_triton.py) against the eager loss, on CPU via Triton's interpreter.

The kernel runs in ONE child process (tests/trainer/triton_interp_worker.py, TRITON_INTERPRET=1 there only:
the variable changes how every Triton kernel of a process runs, so it must not leak into this one). This
process builds the inputs, the child returns the kernel's outputs, and the comparisons against the eager path
(and plain torch) happen here, in float32. Tile sizes are tiny (16, 32) so that V=37 spans several tiles with
a partial last one, and a persistent config (programs_per_sm=1: 2 "SMs" under the interpreter) makes programs
loop over rows. `make test` installs triton (dev extra); elsewhere the module is skipped without it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.test_loss import TERMS, make_case
from trainer.loss import dflash_loss

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

LOSS_CASES = {  # (terms, chunk_size, config): 28 rows in blocks of 4; chunks 8 and 13 -> 12 leave a short last one
    f"{terms}-chunk{chunk}-{config}": (terms, chunk, config)
    for terms in ("ce", "ce+cap") for chunk in (None, 8, 13) for config in (TILED, PERSISTENT)
}


def _loss_inputs(terms: str, chunk):
    hidden, weight, labels, weights, _ = make_case(dtype=torch.float32)  # V=37, zero-weight rows, -100 labels
    kwargs = dict(block_size=4, normalizer=float(weights.sum()) * 1.5, chunk_size=chunk, **TERMS[terms])
    return dict(hidden=hidden, weight=weight, labels=labels, weights=weights, kwargs=kwargs)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case's Triton outputs, from one interpreter subprocess."""
    cases = {}
    for name, spec in KERNEL_CASES.items():
        logits, labels = _logits(*spec["shape"], spec["scale"], seed=len(name))
        cases[name] = dict(op="fused_ce", logits=logits.to(spec.get("dtype", torch.float32)), labels=labels,
                           config=spec["config"], want_grad=spec.get("want_grad", True))
    cases["bad-label"] = dict(op="fused_ce", logits=cases["tiled"]["logits"], config=TILED, want_grad=True,
                              labels=torch.where(torch.arange(9) == 4, 37, cases["tiled"]["labels"]))
    for name, (terms, chunk, config) in LOSS_CASES.items():
        cases[name] = dict(op="loss", config=config, **_loss_inputs(terms, chunk))
    folder = tmp_path_factory.mktemp("triton-interp")
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(WORKER), str(folder / "cases.pt"), str(folder / "out.pt")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-6000:]
    return {"cases": cases, "out": torch.load(folder / "out.pt")}


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
