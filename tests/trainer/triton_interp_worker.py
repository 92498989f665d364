"""Child process of tests/trainer/test_loss_triton.py: runs the fused Triton CE kernel under Triton's CPU
interpreter. Usage: python triton_interp_worker.py CASES_IN OUTPUTS_OUT (both torch.save files).

TRITON_INTERPRET=1 is set here, before anything can define a Triton kernel, and only in this process: it
changes how every @triton.jit function of the process runs, so it must not leak into the pytest process.
Each case is {"op": "fused_ce" | "fused_ce_kl" | "ce_kl_split" | "loss", ...inputs}; the outputs are plain
tensors, compared by the parent.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from tests.trainer.triton_interp import serve_cases
from trainer.kernels.loss_triton import CEKernelConfig, fused_ce, fused_ce_topk
from trainer.kernels.loss_triton_kl import ce_kl_grad, ce_kl_stats, fused_ce_kl
from trainer.training.loss import dflash_loss, make_chunk_kernels


def run_case(case: dict) -> dict:
    if case["op"] == "fused_ce":
        grad, lse, ce, argmax = fused_ce(
            case["logits"], case["labels"], want_grad=case["want_grad"], config=CEKernelConfig.parse(case["config"])
        )
        return {"grad": grad, "lse": lse, "ce": ce, "argmax": argmax}
    if case["op"] == "fused_ce_topk":
        config = CEKernelConfig.parse(case["config"])
        grad, lse, ce, argmax, values, ids = fused_ce_topk(
            case["logits"], case["labels"], case["topk"], want_grad=case["want_grad"], config=config
        )
        plain = fused_ce(case["logits"], case["labels"], want_grad=case["want_grad"], config=config)
        return {"grad": grad, "lse": lse, "ce": ce, "argmax": argmax, "values": values, "ids": ids, "plain": plain}
    if case["op"] in ("fused_ce_kl", "ce_kl_split"):
        return run_kl_case(case)
    kernels = make_chunk_kernels("triton", triton_config=case["config"], kl_triton_config=case["config"])
    hidden = case["hidden"].clone().requires_grad_(True)
    result = dflash_loss(hidden, case["weight"], case["labels"], case["weights"], kernels=kernels, **case["kwargs"])
    result.loss.backward()
    with torch.no_grad():
        evaluated = dflash_loss(
            hidden, case["weight"], case["labels"], case["weights"], kernels=kernels, **case["kwargs"]
        )
    return {
        "loss": result.loss.detach(),
        "grad": hidden.grad,
        "ce_sum": result.ce_sum,
        "cap_sum": result.cap_sum,
        "kl_sum": result.kl_sum,
        "correct": result.correct,
        "eval_loss": evaluated.loss,
        "eval_kl_sum": evaluated.kl_sum,
        "candidates": result.candidates,
        "candidate_logits": result.candidate_logits,
        "label_place": result.label_place,
        "label_found": result.label_found,
    }


def run_kl_case(case: dict) -> dict:
    """fused_ce_kl (into a new buffer, and in place over a copy of the teacher logits), or the two-launch
    ce_kl_stats + ce_kl_grad with a per-row ratio."""
    config = CEKernelConfig.parse(case["config"])
    logits, teacher, labels, temperature = case["logits"], case["teacher"], case["labels"], case["temperature"]
    if case["op"] == "ce_kl_split":
        state, lse, ce, kl, argmax = ce_kl_stats(logits, teacher, labels, temperature=temperature, config=config)
        grad = ce_kl_grad(logits, teacher, labels, state, case["ratio"], temperature=temperature, config=config)
        return {"grad": grad, "lse": lse, "ce": ce, "kl": kl, "argmax": argmax}
    grad, lse, ce, kl, argmax = fused_ce_kl(
        logits,
        teacher,
        labels,
        temperature=temperature,
        kl_ratio=case["ratio"],
        want_grad=case["want_grad"],
        config=config,
    )
    out = {"grad": grad, "lse": lse, "ce": ce, "kl": kl, "argmax": argmax}
    if case["want_grad"]:
        overwritten = teacher.clone()
        in_place = fused_ce_kl(
            logits, overwritten, labels, temperature=temperature, kl_ratio=case["ratio"], out=overwritten, config=config
        )[0]
        out.update(in_place_grad=in_place, overwritten_teacher=overwritten)
    return out


if __name__ == "__main__":
    sys.exit(serve_cases(run_case, sys.argv[1:]))
