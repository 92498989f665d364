"""Child process of tests/trainer/test_conv_triton.py: DFlash2's convolution kernels under Triton's CPU interpreter.
Usage: python conv_interp_worker.py CASES_IN OUTPUTS_OUT (torch.save files). TRITON_INTERPRET=1 is set here only
(it changes how every Triton kernel of the process runs)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from trainer.model.conv_triton import block_conv


def run_case(case: dict) -> dict:
    x, delta, base = (case[k].clone().requires_grad_(True) for k in ("x", "delta", "base"))
    out = block_conv(x, delta, base, block_size=case["block_size"], group_size=case["group_size"])
    dx, ddelta, dbase = torch.autograd.grad(out, (x, delta, base), case["grad_out"])
    return {"out": out.detach(), "dx": dx, "ddelta": ddelta, "dbase": dbase}


def main(argv: list[str]) -> int:
    cases = torch.load(argv[0])
    torch.save({name: run_case(case) for name, case in cases.items()}, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
