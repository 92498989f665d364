"""Child process of tests/trainer/test_conv_in_triton.py: the input-side convolution's kernel gradients
(trainer/kernels/conv_in_triton.py) under Triton's CPU interpreter. Usage: python conv_in_interp_worker.py CASES_IN
OUTPUTS_OUT (torch.save files). TRITON_INTERPRET=1 is set here only, when run as a script (the test module calls
run_case in its own process for the cases that need no kernel: an empty ladder, the torch fallback).

A case's "mode": "op" calls the custom op on (gs, x, rstd, weight, delta, base), gs the case's gradient pieces;
"autograd" differentiates NormedConv.apply(..., fanout=len(gs), triton_backward=True) (the layers' wiring) for xhat,
weight, delta and base, piece i the gradient of view i; "compiled" does the same through torch.compile (aot_eager:
the op traced through its fake implementation, no recompile on a second call).
"configs" replaces the ladder; "smem" sets $DFLASH_SMEM_LIMIT. Each output records which rung ran ("rung", -1 for
the torch fallback) and what it logged."""

from __future__ import annotations

import contextlib
import io
import os
import sys

if __name__ == "__main__":  # the child only: the test module imports run_case for its in-process cases
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from tests.trainer.triton_interp import reset_ladder, serve_cases
from trainer.kernels import conv_in_triton, triton_fit
from trainer.model.dflash2 import NormedConv

DEFAULT_CONFIGS = list(conv_in_triton.CONFIGS)


def run_case(case: dict) -> dict:
    reset_ladder(conv_in_triton, DEFAULT_CONFIGS, case)
    gs, x, rstd, weight, delta, base = (case[k] for k in ("gs", "x", "rstd", "weight", "delta", "base"))
    B, S = case["block_size"], case["group_size"]
    log = io.StringIO()
    out: dict = {}
    with contextlib.redirect_stderr(log):
        if case["mode"] == "op":
            dd, db, dw = conv_in_triton.conv_prepare_kernel_grads(gs, x, rstd, weight, delta, base, B)
        else:
            xhat = (x.to(rstd.dtype) * rstd).to(x.dtype).detach().requires_grad_(True)
            weight, delta, base = (t.detach().clone().requires_grad_(True) for t in (weight, delta, base))

            def conv(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return NormedConv.apply(*t, x, rstd, B, S, gs[0].dtype, len(gs), True)

            leaves = (xhat, weight, delta, base)
            if case["mode"] == "compiled":
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                conv = torch.compile(conv, backend="aot_eager", fullgraph=True)
                torch.autograd.backward(conv(*leaves), list(gs))  # a first call: warm-up
            outs = conv(*leaves)
            dxhat, dw, dd, db = torch.autograd.grad(outs, leaves, list(gs))
            out = {"out": outs[0].detach(), "dxhat": dxhat}
            if case["mode"] == "compiled":
                out["frames"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    verdicts = triton_fit.chosen("conv-prepare-bwd")
    return {**out, "dd": dd, "db": db, "dw": dw, "rung": next(iter(verdicts.values()), -1), "log": log.getvalue()}


if __name__ == "__main__":
    sys.exit(serve_cases(run_case, sys.argv[1:]))
