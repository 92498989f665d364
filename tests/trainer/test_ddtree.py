"""DDTree eval mode against a real tiny Qwen3 target: growth rule, ancestor-mask parity, degenerate = block mode,
per-step budget monotonicity, lossless output, bad budgets."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from tests.trainer.tiny_eval import build_eval_setup
from trainer.evaluation import ddtree
from trainer.evaluation import eval as eval_cli

MAX_NEW = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    world = build_eval_setup(tmp_path_factory.mktemp("ddtree"), num_prompts=4)
    world["references"] = [
        eval_cli.greedy_reference(world["model"], p, MAX_NEW, world["stops"], 0) for p in world["prompts"]
    ]
    world["vocab"] = world["model"].config.vocab_size
    return world


def noisy_oracle(prompt: list[int], reference: list[int], vocab: int):
    """Slot logits that rank the reference token 1st, 2nd or 3rd depending on (position, slot) — a drafter whose
    mistakes a wider tree can repair. Deterministic in its arguments."""

    def slot_logits(committed, taps, slots):
        done = len(committed) - len(prompt)
        logits = torch.zeros((slots, vocab))
        for slot in range(slots):
            position = done + slot
            truth = reference[position] if position < len(reference) else 0
            rank = (position * 7 + slot * 3) % 3  # 0, 1 or 2 wrong tokens ranked above it
            for wrong in range(rank):
                logits[slot, (truth + 1 + wrong) % vocab] = 5.0 - wrong
            logits[slot, truth] = 5.0 - rank
        return logits

    return slot_logits


def test_tree_is_exactly_the_budget_best_paths_and_nested_in_the_budget():
    torch.manual_seed(1)
    log_probs = torch.log_softmax(torch.randn(3, 5) * 2, dim=-1)
    paths = sorted(itertools.product(range(5), repeat=3), key=lambda p: 0)  # all full paths; prefixes below
    scores = {}
    for full in paths:
        for depth in range(1, 4):
            prefix = full[:depth]
            scores[prefix] = sum(float(log_probs[d, t]) for d, t in enumerate(prefix))
    previous: list[int] = []
    for budget in range(1, 20):
        tree = ddtree.build_tree(log_probs, budget)
        got = {tuple(tree.tokens[i] for i in tree.path(n)) for n in range(len(tree))}
        best = sorted(scores.values(), reverse=True)[:budget]
        assert sorted((scores[p] for p in got), reverse=True) == pytest.approx(best)  # the budget best paths
        assert all(p[:-1] in got or len(p) == 1 for p in got)  # prefix-closed
        assert tree.tokens[: len(previous)] == previous  # larger budget: superset
        assert all(tree.parents[n] < n for n in range(len(tree)))  # parents first
        previous = tree.tokens
    chain = ddtree.build_tree(log_probs, 3, top_k=1)
    assert chain.tokens == log_probs.argmax(-1).tolist() and chain.parents == [-1, 0, 1]


def test_accept_follows_the_targets_choice_and_returns_the_bonus():
    tree = ddtree.DraftTree(tokens=[7, 8, 9, 4], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3], scores=[0.0] * 4)
    # rows: anchor, node0 (7), node1 (8), node2 (7->9), node3 (7->9->4)
    assert ddtree.accept(tree, [7, 9, 1, 4, 3]) == ([0, 2, 3], 3)
    assert ddtree.accept(tree, [8, 0, 6, 0, 0]) == ([1], 6)
    assert ddtree.accept(tree, [5, 0, 0, 0, 0]) == ([], 5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_ancestor_mask_gives_every_node_the_logits_of_its_own_path(setup, attention):
    """The tree pass (cached prefix + anchor + all nodes, tree positions, 4-D mask) must give each node the
    logits and taps of a plain causal forward over prefix + anchor + that node's path; and after keeping one
    path the KV cache must equal the plain forward's."""
    model = setup["model"]
    model.set_attn_implementation(attention)
    try:
        prompt = setup["prompts"][0]
        torch.manual_seed(3)
        tree = ddtree.build_tree(torch.log_softmax(torch.randn(3, setup["vocab"]) * 6, dim=-1), 9)
        assert max(tree.depths) == 3 and len(set(tree.parents)) > 2  # a real tree: branches and depth
        runner = eval_cli.TargetRunner(model, [1, 2])
        runner.forward(prompt[:-1])
        n = len(prompt)
        mask = ddtree.tree_attention_mask(tree, n - 1, torch.float32, torch.device("cpu"))
        positions = torch.tensor([[n - 1] + [n - 1 + d for d in tree.depths]])
        logits, taps = runner.forward([prompt[-1]] + tree.tokens, position_ids=positions, attention_mask=mask)
        for node in range(-1, len(tree)):
            path = tree.path(node) if node >= 0 else []
            plain = eval_cli.TargetRunner(model, [1, 2])
            want_logits, want_taps = plain.forward(prompt + [tree.tokens[i] for i in path])
            assert torch.allclose(logits[1 + node], want_logits[-1], atol=1e-5), node
            assert torch.allclose(taps[1 + node], want_taps[-1], atol=1e-5), node
        leaf = max(range(len(tree)), key=lambda i: tree.depths[i])
        kept = [n - 1] + [n + i for i in tree.path(leaf)]
        ddtree.keep_cache_rows(runner.cache, n - 1, kept)
        plain = eval_cli.TargetRunner(model, [1, 2])
        plain.forward(prompt + [tree.tokens[i] for i in tree.path(leaf)])
        assert runner.cache.get_seq_length() == plain.cache.get_seq_length()
        for ours, theirs in zip(runner.cache.layers, plain.cache.layers):
            assert torch.allclose(ours.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(ours.values, theirs.values, atol=1e-5)
    finally:
        model.set_attn_implementation("sdpa")


def run_both(setup, slot_logits_for, budget, top_k):
    block, tree = eval_cli.MethodStats("block"), eval_cli.MethodStats("tree")
    runner = eval_cli.TargetRunner(setup["model"], [1, 2])
    for prompt, reference in zip(setup["prompts"], setup["references"]):
        slot_logits = slot_logits_for(prompt, reference)
        propose = lambda c, t, k, f=slot_logits: f(c, t, k).argmax(-1).tolist()  # noqa: E731
        out_block = eval_cli.speculative_generate(
            runner, prompt, propose, slots=3, max_new_tokens=MAX_NEW, stops=set(setup["stops"]), stats=block
        )
        out_tree = ddtree.ddtree_generate(
            runner,
            prompt,
            slot_logits,
            budget=budget,
            top_k=top_k,
            slots=3,
            max_new_tokens=MAX_NEW,
            stops=set(setup["stops"]),
            stats=tree,
        )
        assert out_block == reference and out_tree == reference  # both lossless
    return block, tree


def test_budget_b_minus_1_top_1_is_block_mode(setup):
    drafter_logits = eval_cli.drafter_slot_logits(
        setup["drafter"], setup["model"].get_input_embeddings().weight, setup["model"].get_output_embeddings().weight
    )
    for slot_logits_for in (lambda p, r: noisy_oracle(p, r, setup["vocab"]), lambda p, r: drafter_logits):
        block, tree = run_both(setup, slot_logits_for, budget=3, top_k=1)
        for key in ("steps", "committed", "generated", "forwards", "slot_proposed", "slot_accepted"):
            assert getattr(block, key) == getattr(tree, key), key
    assert block.summary()["tau"] == tree.summary()["tau"]
    report = eval_cli.evaluate(
        setup["model"],
        setup["drafter"],
        setup["prompts"],
        max_new_tokens=MAX_NEW,
        stops=setup["stops"],
        pad_id=0,
        baselines=False,
        ddtree_budget=3,
        ddtree_top_k=1,
    )
    assert report["methods"]["ddtree"]["tau"] == report["methods"]["trained"]["tau"] and report["lossless"]


def test_a_larger_budget_never_accepts_less_from_the_same_state(setup):
    """Per step this is a theorem (the trees are nested); over a whole generation it is not (a longer accept moves
    the anchor where the drafter may do worse), so the per-step claim is what is tested, at every anchor of
    every reference, for the real drafter and the noisy oracle. The oracle also shows the budget paying off."""
    model = setup["model"]
    drafter_logits = eval_cli.drafter_slot_logits(
        setup["drafter"], model.get_input_embeddings().weight, model.get_output_embeddings().weight
    )
    runner = eval_cli.TargetRunner(model, [1, 2])
    for prompt, reference in zip(setup["prompts"], setup["references"]):
        runner.reset()
        _, first = runner.forward(prompt)
        _, rest = runner.forward(reference)
        taps = torch.cat([first, rest])
        for slot_logits in (drafter_logits, noisy_oracle(prompt, reference, setup["vocab"])):
            for done in range(1, len(reference) - 1):
                committed = prompt + reference[:done]
                log_probs = torch.log_softmax(slot_logits(committed, taps[: len(committed) - 1], 3), dim=-1)
                truth, accepted = reference[done:], []
                for budget in range(1, 16):
                    tree = ddtree.build_tree(log_probs, budget)
                    choice = [truth[0]] + [truth[d] if d < len(truth) else -1 for d in tree.depths]
                    accepted.append(len(ddtree.accept(tree, choice)[0]))  # the target's greedy choices here
                assert accepted == sorted(accepted)
    block, wide = run_both(setup, lambda p, r: noisy_oracle(p, r, setup["vocab"]), budget=12, top_k=None)
    assert wide.summary()["tau"] > block.summary()["tau"] + 0.5


def test_evaluate_reports_ddtree_beside_block_lossless(setup):
    report = eval_cli.evaluate(
        setup["model"],
        setup["drafter"],
        setup["prompts"],
        max_new_tokens=MAX_NEW,
        stops=setup["stops"],
        pad_id=0,
        baselines=False,
        ddtree_budget=8,
    )
    tree = report["methods"]["ddtree"]
    assert report["lossless"] and tree["lossless"] and tree["budget"] == 8 and tree["top_k"] is None
    assert 1 <= tree["mean_tree_nodes"] <= 8 and tree["tau"] >= 1.0 and len(tree["per_slot_acceptance"]) == 3
    table = eval_cli.format_table(report)
    assert "ddtree" in table and "tree budget 8" in table and "trained" in table


def test_a_stop_id_inside_the_accepted_path_ends_the_answer(setup):
    model, prompt = setup["model"], setup["prompts"][1]
    free_run = eval_cli.greedy_reference(model, prompt, 20, [], 0)
    stop_index = 5
    assert free_run[stop_index] not in free_run[:stop_index]
    stops = {free_run[stop_index]}
    reference = free_run[: stop_index + 1]
    stats = eval_cli.MethodStats("tree")
    oracle = noisy_oracle(prompt, free_run, setup["vocab"])
    output = ddtree.ddtree_generate(
        eval_cli.TargetRunner(model, [1, 2]),
        prompt,
        oracle,
        budget=12,
        top_k=None,
        slots=3,
        max_new_tokens=20,
        stops=stops,
        stats=stats,
    )
    assert output == reference and stats.generated == len(reference) and stats.forwards == stats.steps + 1
    # The step that accepts the stop still counts accepted + 1 (block mode's and tau_sim's convention), so the
    # committed count is the prefill token short of the output plus one; nothing past the stop is verified.
    assert stats.committed == len(reference)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ddtree-budget", "0"], "--ddtree-budget 0 must be a positive number of tree nodes"),
        (["--ddtree-budget", "-3"], "--ddtree-budget -3 must be a positive number of tree nodes"),
        (["--ddtree-budget", "4", "--ddtree-top-k", "0"], "--ddtree-top-k 0 must be a positive number"),
        (["--ddtree-top-k", "2"], "--ddtree-top-k needs --ddtree-budget"),
    ],
)
def test_bad_ddtree_options_are_refused_before_anything_loads(tmp_path, capsys, argv, message):
    code = eval_cli.main(
        [
            "--target-model",
            str(tmp_path / "none"),
            "--drafter",
            str(tmp_path / "none"),
            "--prompts",
            str(tmp_path / "none.jsonl"),
            *argv,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and "hint:" in err


def test_bad_budget_in_evaluate_and_unsupported_attention(setup):
    for budget in (0, -1):
        with pytest.raises(eval_cli.DataInputError, match=f"--ddtree-budget {budget} must be a positive"):
            eval_cli.evaluate(
                setup["model"],
                setup["drafter"],
                setup["prompts"],
                max_new_tokens=4,
                stops=setup["stops"],
                pad_id=0,
                ddtree_budget=budget,
            )
    with pytest.raises(ValueError, match="--ddtree-budget 0"):
        ddtree.build_tree(torch.zeros(2, 4), 0)

    class FlashConfig:
        _attn_implementation = "flash_attention_2"

    class FlashModel:
        config = FlashConfig()

    with pytest.raises(eval_cli.DataInputError, match="DDTree needs eager or sdpa attention"):
        eval_cli.check_ddtree_options(4, None, FlashModel())


def test_eval_cli_with_ddtree(setup, tmp_path, capsys):
    setup["drafter"].save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "walk north from bop"}\n{"prompt": "walk east"}\n')
    code = eval_cli.main(
        [
            "--target-model",
            str(setup["root"] / "target"),
            "--drafter",
            str(tmp_path / "drafter"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--enable-thinking",
            "off",
            "--no-baselines",
            "--ddtree-budget",
            "6",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert set(report["methods"]) == {"trained", "ddtree"} and report["methods"]["ddtree"]["budget"] == 6
    assert report["lossless"] and "tree budget 6" in captured.err
    assert not math.isnan(report["methods"]["ddtree"]["tau"])
