"""Child process of tests/trainer/test_conv_triton.py: DFlash2's convolution kernels under Triton's CPU interpreter.
Usage: python conv_interp_worker.py CASES_IN OUTPUTS_OUT (torch.save files). TRITON_INTERPRET=1 is set here only
(it changes how every Triton kernel of the process runs)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from tests.trainer.triton_interp import serve_cases
from trainer.kernels.conv_triton import block_conv


def run_case(case: dict) -> dict:
    x, delta, base = (case[k].clone().requires_grad_(True) for k in ("x", "delta", "base"))
    out = block_conv(x, delta, base, block_size=case["block_size"], group_size=case["group_size"])
    dx, ddelta, dbase = torch.autograd.grad(out, (x, delta, base), case["grad_out"])
    return {"out": out.detach(), "dx": dx, "ddelta": ddelta, "dbase": dbase}


if __name__ == "__main__":
    sys.exit(serve_cases(run_case, sys.argv[1:]))
