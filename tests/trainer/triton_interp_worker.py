"""Child process of tests/trainer/test_loss_triton.py: runs the fused Triton CE kernel under Triton's CPU
interpreter. Usage: python triton_interp_worker.py CASES_IN OUTPUTS_OUT (both torch.save files).

TRITON_INTERPRET=1 is set here, before anything can define a Triton kernel, and only in this process: it
changes how every @triton.jit function of the process runs, so it must not leak into the pytest process.
Each case is {"op": "fused_ce" | "loss", ...inputs}; the outputs are plain tensors, compared by the parent.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from trainer.loss import dflash_loss, make_chunk_kernels  # noqa: E402
from trainer.loss_triton import CEKernelConfig, fused_ce  # noqa: E402


def run_case(case: dict) -> dict:
    if case["op"] == "fused_ce":
        grad, lse, ce, argmax = fused_ce(case["logits"], case["labels"], want_grad=case["want_grad"],
                                         config=CEKernelConfig.parse(case["config"]))
        return {"grad": grad, "lse": lse, "ce": ce, "argmax": argmax}
    kernels = make_chunk_kernels("triton", triton_config=case["config"])
    hidden = case["hidden"].clone().requires_grad_(True)
    result = dflash_loss(hidden, case["weight"], case["labels"], case["weights"], kernels=kernels, **case["kwargs"])
    result.loss.backward()
    with torch.no_grad():
        evaluated = dflash_loss(hidden, case["weight"], case["labels"], case["weights"], kernels=kernels,
                                **case["kwargs"])
    return {"loss": result.loss.detach(), "grad": hidden.grad, "ce_sum": result.ce_sum, "cap_sum": result.cap_sum,
            "correct": result.correct, "eval_loss": evaluated.loss}


def main(argv: list[str]) -> int:
    cases = torch.load(argv[0])
    torch.save({name: run_case(case) for name, case in cases.items()}, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
