"""Child process of tests/trainer/test_adamw_triton.py: trainer/kernels/adamw_triton.py's kernel under Triton's CPU
interpreter. Usage: python adamw_interp_worker.py CASES_IN OUTPUTS_OUT (torch.save files). TRITON_INTERPRET=1 is set
here only (it changes how every Triton kernel of the process runs)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"


from tests.trainer.triton_interp import serve_cases
from trainer.kernels.adamw_triton import TritonAdamW
from trainer.training.step import load_optimizer_state


def run_case(case: dict) -> dict:
    """Steps of TritonAdamW over the case's gradients; from its `resume` state dict when given (the parameters
    then start from `params`, as a resumed run's model does)."""
    params = [p.clone() for p in case["params"]]
    opt = TritonAdamW(params, lr=case["lr"][0], weight_decay=case["weight_decay"])
    if case.get("resume") is not None:
        load_optimizer_state(opt, case["resume"])  # as the engines resume: this optimizer keeps its own flags
    flags = [(g["fused"], g["foreach"]) for g in opt.param_groups]
    for step, grads in enumerate(case["grads"]):
        for group in opt.param_groups:
            group["lr"] = case["lr"][step]
        for p, g in zip(params, grads):
            if g is not None and g.dtype != p.dtype:
                p.grad_dtype = None  # torch >= 2.10 refuses a gradient of another dtype unless told
            p.grad = None if g is None else g.clone()
        scale = case["scales"][step]
        opt.grad_scale = None if scale is None else scale.clone()
        opt.step()
    return {"params": params, "state": opt.state_dict(), "flags": flags}


if __name__ == "__main__":
    sys.exit(serve_cases(run_case, sys.argv[1:]))
