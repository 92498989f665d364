"""DFlash2 (--arch dflash2, trainer/model/dflash2.py) on the CPU with the tiny preset (dense attention path): the
convolutions' identity start and block locality, the selector objective's candidates, the threaded pipeline with
two compiled replicas under the compile guard (zero recompiles after warm-up), SIGTERM + resume reproducing the
uninterrupted run bitwise, and eval's reranking (lossless, per-slot acceptance)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.tiny import build_tiny_target, tiny_drafter_config, tiny_train_config
from trainer.evaluation import eval as eval_cli
from trainer.model.dflash2 import (
    CandidateSelector,
    GroupedDynamicConv,
    block_predecessors,
    grouped_dynamic_conv,
    select_block,
    selector_loss,
    training_candidates,
)
from trainer.model.drafter import DFlashDrafter
from trainer.pipeline.replica_sync import max_replica_difference
from trainer.pipeline_run import PipelineOptions, run_pipeline
from trainer.train import EXIT_OK

pytestmark = pytest.mark.timeout(240)
DFLASH2 = ("--arch", "dflash2", "--selector-top-k", "8", "--selector-rank", "16")


def _cfg(out: Path, *extra: str):
    return tiny_train_config(out, *DFLASH2, *extra)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(sorted((out / "checkpoints").glob("step_*"))[-1] / "model.safetensors"))


def _drafters(block: int = 4) -> tuple[DFlashDrafter, DFlashDrafter]:
    target = build_tiny_target(seed=0)
    base = tiny_drafter_config(target, block_size=block)
    torch.manual_seed(0)
    dflash = DFlashDrafter(base)
    dflash2 = DFlashDrafter(dataclasses.replace(base, arch="dflash2", selector_top_k=8, selector_rank=16))
    dflash2.load_state_dict(dflash.state_dict(), strict=False)  # the shared tensors; convs stay at identity
    return dflash, dflash2


def _forward(model: DFlashDrafter, block_embeds: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    cfg = model.config
    ctx = torch.randn(1, 9, cfg.num_taps * cfg.hidden_size, generator=generator)
    anchors, keep = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    with torch.no_grad():
        return model(ctx, block_embeds, anchors, keep, "dense")


def test_fresh_convolutions_are_the_identity_and_change_the_output_once_trained() -> None:
    dflash, dflash2 = _drafters()
    extra = set(dflash2.state_dict()) - set(dflash.state_dict())
    assert len(extra) == 4 * 2 + 3 and set(dflash.state_dict()) < set(dflash2.state_dict())
    embeds = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_forward(dflash, embeds), _forward(dflash2, embeds))
    with torch.no_grad():
        dflash2.layers[0].mlp_conv.kernel_projection.weight.normal_(std=0.5)
    assert (_forward(dflash, embeds) - _forward(dflash2, embeds)).abs().max() > 1e-3


def test_the_convolution_is_causal_inside_the_block_and_never_crosses_it() -> None:
    generator = torch.Generator().manual_seed(3)
    block, kernel, hidden, group = 4, 3, 8, 2
    x = torch.randn(2, 3 * block, hidden, generator=generator)
    delta = torch.randn(2, 3 * block, kernel, hidden // group, generator=generator)
    base = torch.randn(kernel, hidden, generator=generator)
    out = grouped_dynamic_conv(x, delta, base, block_size=block, group_size=group)
    for position in range(3 * block):  # slot j = position % B reads slots j-t >= 0 of its block only
        expect = torch.zeros(2, hidden)
        for tap in range(min(kernel, position % block + 1)):
            coefficient = base[tap] + delta[:, position, tap].repeat_interleave(group, dim=-1)
            expect += x[:, position - tap] * coefficient
        torch.testing.assert_close(out[:, position], expect)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("block", "kernel", "hidden", "group"), [(4, 2, 8, 2), (4, 3, 8, 4), (8, 2, 32, 16), (4, 1, 8, 2)]
)
def test_the_layers_convolution_has_the_reference_values_and_gradients(
    dtype: torch.dtype, block: int, kernel: int, hidden: int, group: int
) -> None:
    """GroupedDynamicConv (the layers' form: index shift forward, hand-written backward) against autograd through
    grouped_dynamic_conv: the same forward bits, gradients equal to rounding. delta is a strided view, as in
    BlockConv.prepare (the input side's half of one projection)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3 * block, hidden, generator=generator, dtype=dtype, requires_grad=True)
    kernels = torch.randn(2, 3 * block, 2, kernel, hidden // group, generator=generator, dtype=dtype)
    kernels.requires_grad_(True)
    base = torch.randn(kernel, hidden, generator=generator, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(2, 3 * block, hidden, generator=generator, dtype=dtype)
    ref = grouped_dynamic_conv(x, kernels[..., 0, :, :], base, block_size=block, group_size=group)
    out = GroupedDynamicConv.apply(x, kernels[..., 0, :, :], base, block, group)
    assert torch.equal(out, ref)
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for got, want in zip(
        torch.autograd.grad(out, (x, kernels, base), grad_out),
        torch.autograd.grad(ref, (x, kernels, base), grad_out),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **tolerance)


def test_the_layers_convolution_saves_no_shifted_copy_for_the_backward() -> None:
    """What the min-cut partitioner keeps for the backward of norm -> convolution (the input side, as compiled in
    the layer): autograd's form saves the constant_pad_nd of the normed input (the partitioner never recomputes a
    pad: a [rows, H] float32 copy written in the forward and read in the backward, bench/results/kernels.md 2026-12-04 "DFlash2's convolutions rewritten for Inductor");
    GroupedDynamicConv saves only what the norm's backward keeps anyway."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def saved_ops(conv) -> set[str]:
        graphs = []

        def forward_compiler(gm: torch.fx.GraphModule, _inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        backend = aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
            partition_fn=min_cut_rematerialization_partition,
        )

        def layer(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
            normed = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            return conv(normed, delta, base)

        torch._dynamo.reset()
        compiled = torch.compile(layer, backend=backend, fullgraph=True)
        generator = torch.Generator().manual_seed(8)
        inputs = [
            torch.randn(2, 8, 16, generator=generator),
            torch.ones(16),
            torch.randn(2, 8, 2, 4, generator=generator),
            torch.randn(2, 16, generator=generator),
        ]
        compiled(*[t.requires_grad_(True) for t in inputs]).sum().backward()
        (output,) = [node for node in graphs[0].graph.nodes if node.op == "output"]
        return {str(node.target) for node in output.args[0][1:] if isinstance(node, torch.fx.Node)}

    assert "aten.constant_pad_nd.default" in saved_ops(
        lambda x, d, b: grouped_dynamic_conv(x, d, b, block_size=4, group_size=4)
    )
    assert not {op for op in saved_ops(lambda x, d, b: GroupedDynamicConv.apply(x, d, b, 4, 4)) if "pad" in op}


def test_training_candidates_put_a_missing_label_last_and_predecessors_are_teacher_forced() -> None:
    candidates = torch.tensor([[5, 3, 9], [5, 3, 9]])
    ids, place, found = training_candidates(candidates, torch.tensor([3, 7]))
    assert ids.tolist() == [[5, 3, 9], [5, 3, 7]] and place.tolist() == [1, 2] and found.tolist() == [True, False]
    block_ids = torch.tensor([[10, 99, 99, 99, 20, 99, 99, 99]])
    labels = torch.tensor([[0, 11, 12, 13, 0, 21, 0, 0]])  # 0: unsupervised
    assert block_predecessors(block_ids, labels, 4).tolist() == [[10, 10, 11, 12, 20, 20, 21, 0]]


def test_the_selector_objective_is_the_k_way_cross_entropy_of_slots_1_and_up() -> None:
    """selector_loss (which projects every slot's hidden, then drops slot 0) against the objective written out from
    transition() row by row: the same sum of weighted CEs, the same gradients, the picks the scores' argmax."""
    generator = torch.Generator().manual_seed(9)
    block, k, hidden_size = 4, 5, 16
    torch.manual_seed(9)
    selector = CandidateSelector(vocab_size=50, hidden_size=hidden_size, rank=8, top_k=k, init_std=0.5)
    rows = 3 * block
    hidden = torch.randn(rows, hidden_size, generator=generator, requires_grad=True)
    predecessors = torch.randint(0, 50, (rows,), generator=generator)
    candidates = torch.randint(0, 50, (rows, k), generator=generator)
    logits = torch.randn(rows, k, generator=generator)
    place = torch.randint(0, k, (rows,), generator=generator)
    weights = torch.rand(rows, generator=generator)
    ce_sum, pick = selector_loss(selector, hidden, predecessors, candidates, logits, place, weights, block_size=block)
    want, picks = torch.zeros(()), []
    for i in range(rows):
        if i % block == 0:
            picks.append(0)
            continue
        scores = logits[i] + selector.transition(hidden[i], predecessors[i], candidates[i])
        want = want + weights[i] * torch.nn.functional.cross_entropy(scores[None], place[i : i + 1])
        picks.append(int(candidates[i, scores.argmax()]))
    torch.testing.assert_close(ce_sum, want)
    assert pick.tolist() == picks
    params = [hidden, selector.hidden_projection.weight, selector.predecessor_codebook, selector.successor_codebook]
    for got, expect in zip(torch.autograd.grad(ce_sum, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(got, expect)


def test_select_block_follows_its_own_picks_left_to_right() -> None:
    _, dflash2 = _drafters()
    selector = dflash2.candidate_selector
    assert selector is not None
    generator = torch.Generator().manual_seed(4)
    logits, hidden = torch.randn(3, 256, generator=generator), torch.randn(3, 64, generator=generator)
    picks = select_block(selector, logits, hidden, anchor_token=17)
    previous = 17
    for j, pick in enumerate(picks):
        unary, candidates = logits[j].topk(8)
        scores = unary + selector.transition(hidden[j], torch.tensor(previous), candidates)
        assert pick == int(candidates[scores.argmax()])
        previous = pick
    with torch.no_grad():
        selector.successor_codebook.zero_()  # no transition score: the plain argmax
    assert select_block(selector, logits, hidden, anchor_token=17) == logits.argmax(-1).tolist()


def test_two_compiled_dflash2_replicas_train_in_threads_without_a_recompile(tmp_path: Path) -> None:
    """The pipeline's compile guard fails the run on any compile after warm-up; grad sync keeps them equal."""
    torch.set_num_threads(1)
    seen: list[tuple[float, bool]] = []
    options = PipelineOptions(
        compile_backend="eager",
        on_step=lambda step, sides: seen.append(
            (max_replica_difference([s.drafter for s in sides]), all(s.compiled for s in sides))
        ),
    )
    out = tmp_path / "run"
    args = ("--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu", "--sync", "grad", "--max-steps", "10")
    assert run_pipeline(_cfg(out, *args), options) == EXIT_OK
    assert seen == [(0.0, True)] * 10
    records = _metrics(out)
    assert all(r["sel_tau_sim"] >= 1.0 and len(r["sel_acc_slot"]) == 7 for r in records)
    assert records[-1]["sel_ce"] < records[0]["sel_ce"]  # the selector objective is learning
    assert any(name.startswith("candidate_selector.") for name in _final_weights(out))


def test_sigterm_then_resume_reproduces_the_uninterrupted_dflash2_run(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    args = ("--target-gpus", "cpu,cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", "6")

    def terminate_at_3(step: int, sides) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    stopped, reference = tmp_path / "stopped", tmp_path / "reference"
    assert run_pipeline(_cfg(stopped, *args), PipelineOptions(on_step=terminate_at_3)) == 128 + signal.SIGTERM
    assert run_pipeline(_cfg(stopped, *args)) == EXIT_OK  # --resume auto
    assert run_pipeline(_cfg(reference, *args)) == EXIT_OK
    keys = ("loss", "sel_ce", "sel_tau_sim", "tau_sim")
    assert [[m[k] for k in keys] for m in _metrics(stopped)] == [[m[k] for k in keys] for m in _metrics(reference)]
    final = _final_weights(reference)
    assert sum(1 for name in final if "_conv." in name) == 2 * 2 * 2
    for name, tensor in final.items():
        assert torch.equal(_final_weights(stopped)[name], tensor), name


def test_eval_reranks_with_the_selector_and_stays_lossless(tmp_path: Path) -> None:
    from tests.trainer.tiny_eval import build_eval_setup

    setup = build_eval_setup(tmp_path, num_prompts=2)
    trained = setup["drafter"]
    config = dataclasses.replace(trained.config, arch="dflash2", selector_top_k=8, selector_rank=16)
    torch.manual_seed(5)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(trained.state_dict(), strict=False)
    assert drafter.candidate_selector is not None
    with torch.no_grad():  # a selector strong enough to change picks
        drafter.candidate_selector.successor_codebook.mul_(100.0)
    report = eval_cli.evaluate(
        setup["model"], drafter, setup["prompts"], max_new_tokens=16, stops=setup["stops"], pad_id=0
    )
    assert {"trained", "trained_unary"} <= set(report["methods"]) and report["lossless"]
    for name in ("trained", "trained_unary"):
        assert len(report["methods"][name]["per_slot_acceptance"]) == config.block_size - 1
    assert "trained_unary" in eval_cli.format_table(report)
