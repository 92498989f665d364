"""Child process of tests/trainer/test_conv_bwd_triton.py: the output-side convolution's backward kernel
(trainer/kernels/conv_bwd_triton.py) under Triton's CPU interpreter. Usage: python conv_bwd_interp_worker.py CASES_IN
OUTPUTS_OUT (torch.save files). TRITON_INTERPRET=1 is set here only (it changes how every Triton kernel of the
process runs).

A case's "mode": "op" calls the custom op on (g, y, delta, base); "autograd" differentiates
GroupedDynamicConv.apply(..., triton_backward=True) (the layers' wiring); "compiled" does the same through
torch.compile (aot_eager: the op traced through its fake implementation, no recompile on a second call).
"configs" replaces the ladder; "smem" sets $DFLASH_SMEM_LIMIT (under the interpreter: the ladder's first rung is
refused). Each output records which rung ran ("rung", -1 for the torch fallback) and what it logged."""

from __future__ import annotations

import contextlib
import io
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from tests.trainer.triton_interp import reset_ladder, serve_cases
from trainer.kernels import conv_bwd_triton, triton_fit
from trainer.model.dflash2 import GroupedDynamicConv

DEFAULT_CONFIGS = list(conv_bwd_triton.CONFIGS)


def run_case(case: dict) -> dict:
    reset_ladder(conv_bwd_triton, DEFAULT_CONFIGS, case)
    g, y, delta, base = (case[k] for k in ("g", "y", "delta", "base"))
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        if case["mode"] == "op":
            dy, dd, db = conv_bwd_triton.conv_finish_backward(g, y, delta, base, case["block_size"])
            out: dict[str, object] = {}
        else:
            y, delta, base = (t.detach().clone().requires_grad_(True) for t in (y, delta, base))

            def conv(a: torch.Tensor, d: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return GroupedDynamicConv.apply(a, d, b, case["block_size"], case["group_size"], True)

            if case["mode"] == "compiled":
                torch._dynamo.reset()
                counters = torch._dynamo.utils.counters
                counters.clear()
                conv = torch.compile(conv, backend="aot_eager", fullgraph=True)
                conv(y, delta, base).backward(g)  # a first call: warm-up
                y.grad = delta.grad = base.grad = None
            out_t = conv(y, delta, base)
            dy, dd, db = torch.autograd.grad(out_t, (y, delta, base), g)
            out = {"out": out_t.detach()}
            if case["mode"] == "compiled":
                out["frames"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    verdicts = triton_fit.chosen("conv-finish-bwd")
    return {**out, "dy": dy, "dd": dd, "db": db, "rung": next(iter(verdicts.values()), -1), "log": log.getvalue()}


if __name__ == "__main__":
    sys.exit(serve_cases(run_case, sys.argv[1:]))
