"""eval: speculative decoding against a real tiny Qwen3 target; lossless, tau bookkeeping, baselines, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.trainer import bench_scripts
from tests.trainer.tiny_eval import build_eval_setup
from trainer.evaluation import eval as eval_cli
from trainer.model.drafter import DFlashDrafter, DrafterConfig, make_block_input_ids
from trainer.model.target import TargetModel


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_eval_setup(tmp_path_factory.mktemp("eval"), num_prompts=3)


def test_oracle_proposer_accepts_whole_blocks_and_garbage_accepts_nothing(setup):
    model, prompt, stops = setup["model"], setup["prompts"][0], setup["stops"]
    reference = eval_cli.greedy_reference(model, prompt, 20, stops, 0)
    runner = eval_cli.TargetRunner(model, [1, 2])

    def oracle(committed, taps, slots):
        done = len(committed) - len(prompt)
        return reference[done : done + slots]

    stats = eval_cli.MethodStats("oracle")
    output = eval_cli.speculative_generate(
        runner, prompt, oracle, slots=3, max_new_tokens=20, stops=set(stops), stats=stats
    )
    assert output == reference
    # 1 token from the prefill, then 4 per step (3 accepted + bonus) until the length limit.
    assert stats.steps == -(-(len(reference) - 1) // 4) and stats.slot_accepted[0] == stats.slot_proposed[0]
    garbage = eval_cli.MethodStats("garbage")

    def wrong(committed, taps, slots):
        return [(t + 1) % 300 for t in reference[len(committed) - len(prompt) :][:slots]]

    assert (
        eval_cli.speculative_generate(
            runner, prompt, wrong, slots=3, max_new_tokens=20, stops=set(stops), stats=garbage
        )
        == reference
    )
    assert garbage.summary()["tau"] == 1.0 and garbage.steps == len(reference) - 1


def test_generation_ends_at_a_stop_id_accepted_inside_a_draft(setup):
    """Regression: the loop only looked at the LAST committed token, so a stop id accepted mid-draft was followed
    by more verify steps over text past the answer's end (until max_new_tokens), each counted in tau. On the
    demo this pulled tau on TRAINING prompts from 5.83 to 3.64."""
    model, prompt = setup["model"], setup["prompts"][1]
    free_run = eval_cli.greedy_reference(model, prompt, 20, [], 0)  # this target never emits a stop by itself
    stop_index = 5
    assert free_run[stop_index] not in free_run[:stop_index]
    stops = {free_run[stop_index]}  # pretend that token ends the turn
    reference = eval_cli.greedy_reference(model, prompt, 20, sorted(stops), 0)
    assert reference == free_run[: stop_index + 1]

    def oracle(committed, taps, slots):  # drafts the free run, past the stop too
        done = len(committed) - len(prompt)
        return free_run[done : done + slots]

    stats = eval_cli.MethodStats("oracle")
    runner = eval_cli.TargetRunner(model, [1, 2])
    output = eval_cli.speculative_generate(runner, prompt, oracle, slots=3, max_new_tokens=20, stops=stops, stats=stats)
    assert output == reference
    # prefill -> token 0; step 1 commits 1..3 + bonus 4; step 2 accepts the stop (token 5) as its first slot and ends.
    assert stats.steps == 2 and stats.forwards == 3
    assert stats.committed == 4 + 2  # accepted + 1 per step, as tau_sim counts
    assert stats.slot_proposed == [2, 1, 1] and stats.slot_accepted == [2, 1, 1]  # slots past the stop: not counted
    assert runner.cache.get_seq_length() == len(prompt) + stop_index  # cache = committed positions but the last


def test_training_forward_and_eval_proposer_draft_the_same_tokens(setup):
    """The same drafter on the same tokens: the training forward (all anchors at once, dense mask, TargetModel
    features of the whole sequence) and eval's proposer (one block, taps from the KV-cached runner) must draft
    identical tokens at every anchor, or eval's tau would not measure what training's tau_sim measures."""
    model, drafter, prompt = setup["model"], setup["drafter"], setup["prompts"][0]
    cfg = drafter.config
    ids = prompt + eval_cli.greedy_reference(model, prompt, 12, [], 0)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    anchors = torch.arange(len(prompt) - 1, len(ids) - 1)[None]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        features = TargetModel(model, cfg.target_layer_ids).features(torch.tensor([ids])).taps
        blocks = F.embedding(
            make_block_input_ids(torch.tensor([ids]), anchors, cfg.block_size, cfg.mask_token_id), embed
        )
        hidden = drafter(features, blocks, anchors, keep, drafter.build_mask(anchors, keep, len(ids)))
    trained = (hidden[0] @ head.T).argmax(-1).view(-1, cfg.block_size)[:, 1:].tolist()
    runner = eval_cli.TargetRunner(model, cfg.target_layer_ids)
    _, first = runner.forward(ids[: len(prompt)])
    _, rest = runner.forward(ids[len(prompt) :])  # incremental taps, as eval builds them
    taps = torch.cat([first, rest])
    propose = eval_cli.drafter_proposer(drafter, embed, head)
    proposed = [propose(ids[: p + 1], taps[:p], cfg.block_size - 1) for p in anchors[0].tolist()]
    assert proposed == trained
    assert len({tuple(d) for d in trained}) > 1  # anchors really draft different tokens


def test_runner_taps_match_the_training_target_features(setup):
    model, prompt = setup["model"], setup["prompts"][1]
    runner = eval_cli.TargetRunner(model, [1, 2])
    _, first = runner.forward(prompt[:5])
    _, rest = runner.forward(prompt[5:])  # incremental, through the KV cache
    features = TargetModel(model, [1, 2]).features(torch.tensor([prompt])).taps[0]
    assert torch.allclose(torch.cat([first, rest]), features, atol=1e-5)


def test_evaluate_reports_all_methods_lossless(setup):
    report = eval_cli.evaluate(
        setup["model"], setup["drafter"], setup["prompts"], max_new_tokens=16, stops=setup["stops"], pad_id=0
    )
    assert set(report["methods"]) == {"trained", "untrained", "ngram"} and report["lossless"]
    for method in report["methods"].values():
        assert method["tau"] >= 1.0 and len(method["per_slot_acceptance"]) == 3
        assert method["tokens_per_target_forward"] > 0
    table = eval_cli.format_table(report)
    assert "trained" in table and "ngram" in table


def test_the_real_world_bench_pools_a_kinds_tau_as_its_prompts_alone_give_it(setup):
    """bench/real_world.py's held-out tau by kind of prompt, from one report's per-prompt counts."""
    real_world = bench_scripts.load("real_world")
    common = {"max_new_tokens": 16, "stops": setup["stops"], "pad_id": 0, "trained": False}
    model, drafter, prompts = setup["model"], setup["drafter"], setup["prompts"]
    # prompt lookup: its prompts' tau differ here (14, 15 and 12 steps for 15 tokens each), the tiny drafter's do not
    whole = eval_cli.evaluate(model, drafter, prompts, **common)["methods"]["ngram"]
    by_kind = real_world.tau_by_kind(whole, ["code", "chat", "code"])
    code = eval_cli.evaluate(model, drafter, [prompts[0], prompts[2]], **common)["methods"]["ngram"]["tau"]
    chat = eval_cli.evaluate(model, drafter, [prompts[1]], **common)["methods"]["ngram"]["tau"]
    assert by_kind == {"chat": chat, "code": code} and chat != code
    with pytest.raises(ValueError):  # a kind for every prompt, or no answer
        real_world.tau_by_kind(whole, ["code", "chat"])


def test_reports_of_prompt_slices_merge_into_the_whole_report(setup):
    """bench/real_world.py evaluates slices of the prompts in several processes and merges their reports."""
    common = {"max_new_tokens": 16, "stops": setup["stops"], "pad_id": 0}
    model, drafter, prompts = setup["model"], setup["drafter"], setup["prompts"]
    whole = eval_cli.evaluate(model, drafter, prompts, **common)
    parts = [
        eval_cli.evaluate(model, drafter, prompts[:1], **common),
        eval_cli.evaluate(model, drafter, prompts[1:], **common),
    ]
    assert eval_cli.merge_reports(parts) == whole
    for method in whole["methods"].values():  # each prompt's counts, in order, add up to the method's
        assert len(method["prompt_steps"]) == len(method["prompt_committed"]) == len(prompts)
        assert sum(method["prompt_steps"]) == method["steps"] and sum(method["prompt_committed"]) == method["committed"]
    # one prompt's counts are what that prompt alone gives
    alone = eval_cli.evaluate(model, drafter, prompts[1:2], **common)["methods"]["trained"]
    assert [alone["steps"], alone["committed"]] == [
        whole["methods"]["trained"]["prompt_steps"][1],
        whole["methods"]["trained"]["prompt_committed"][1],
    ]
    bad = [{**parts[0], "methods": {**parts[0]["methods"]}} for _ in range(2)]  # a mismatch in the second slice
    bad[1]["methods"]["ngram"] = {**bad[1]["methods"]["ngram"], "mismatched_prompts": [0], "lossless": False}
    merged = eval_cli.merge_reports(bad)
    assert merged["methods"]["ngram"]["mismatched_prompts"] == [1] and not merged["lossless"]
    assert merged["methods"]["trained"]["steps"] == 2 * parts[0]["methods"]["trained"]["steps"]


def test_the_acceptance_table_has_no_trailing_blanks_where_a_slot_was_never_reached() -> None:
    method = {"tau": 1.5, "tokens_per_target_forward": 1.5, "lossless": True, "per_slot_acceptance": [0.5, None]}
    lines = eval_cli.format_table({"methods": {"ngram": method}}).splitlines()
    assert lines[1].endswith("0.50   -") and all(line == line.rstrip() for line in lines), lines


def test_ngram_proposer_copies_what_followed_the_last_match():
    propose = eval_cli.ngram_proposer(max_ngram=2)
    assert propose([5, 6, 7, 8, 1, 6, 7], torch.empty(0), 3) == [8, 1, 6]
    assert propose([1, 2, 3], torch.empty(0), 3) == []


def test_drafter_that_does_not_fit_the_target_is_refused(setup):
    config = setup["drafter"].config
    too_deep = DrafterConfig(**{**config.__dict__, "target_layer_ids": [1, 7], "num_target_layers": 8})
    with pytest.raises(eval_cli.DataInputError, match="target has 4 layers but the drafter taps"):
        eval_cli.evaluate(
            setup["model"], DFlashDrafter(too_deep), setup["prompts"], max_new_tokens=4, stops=setup["stops"], pad_id=0
        )
    wide = DrafterConfig(**{**config.__dict__, "hidden_size": 48})
    with pytest.raises(eval_cli.DataInputError, match="hidden_size 48 != target hidden size 32"):
        eval_cli.evaluate(
            setup["model"], DFlashDrafter(wide), setup["prompts"], max_new_tokens=4, stops=setup["stops"], pad_id=0
        )
    with pytest.raises(eval_cli.DataInputError, match="--block-size 9 must be in 2..4"):
        eval_cli.evaluate(
            setup["model"],
            setup["drafter"],
            setup["prompts"],
            max_new_tokens=4,
            block_size=9,
            stops=setup["stops"],
            pad_id=0,
        )


def test_slices_in_worker_processes_and_baselines_apart_give_the_one_process_report(setup, tmp_path):
    """eval_workers, in two real spawned processes: the trained drafter's slices, the baselines alone (from the
    drafter's config: `make demo-real` runs them while the drafter trains) and the target's references, joined, are
    what one `evaluate` of everything in this process gives."""
    from trainer.evaluation import eval_workers
    from trainer.evaluation.eval_workers import EvalJob

    common = {"max_new_tokens": 16, "stops": setup["stops"], "pad_id": 0}
    model, drafter, prompts, target_dir = setup["model"], setup["drafter"], setup["prompts"], setup["root"] / "target"
    torch.set_num_threads(1)  # as in the workers: the same float sums, so the same greedy answers
    whole = eval_cli.evaluate(model, drafter, prompts, **common)
    refs = eval_cli.greedy_references(model, prompts, **common)
    drafter.save_pretrained(tmp_path / "drafter")
    with eval_workers.worker_pool(2) as pool:
        trained = eval_workers.submit_evaluation(
            pool, 2, target_dir, tmp_path / "drafter", EvalJob(prompts, refs), None, common
        )
        alone = EvalJob(prompts, refs, trained=False, baselines=True)
        baselines = eval_workers.submit_evaluation(pool, 2, target_dir, drafter.config, alone, None, common)
        answers = [
            pool.submit(eval_workers.references, target_dir, cut, common) for cut in eval_workers.slices(prompts, 2)
        ]
        assert len(trained) == len(baselines) == len(answers) == 2  # three prompts: slices of two and one
        assert eval_workers.joined(eval_workers.merged(trained), eval_workers.merged(baselines)) == whole
        assert [answer for part in answers for answer in part.result()] == refs
    assert set(eval_workers.merged(baselines)["methods"]) == {"untrained", "ngram"}
    with pytest.raises(ValueError, match="neither"):
        eval_cli.evaluate(model, drafter, prompts, trained=False, baselines=False, **common)


def test_eval_cli_end_to_end(setup, tmp_path, capsys):
    setup["drafter"].save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "walk north from bop"}\n{"messages": [{"role": "user", "content": "walk east"}]}\n')
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
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["prompts"] == 2 and report["lossless"] and json.loads((tmp_path / "r.json").read_text()) == report
    assert "per-slot acceptance" in captured.err
    code = eval_cli.main(
        [
            "--target-model",
            str(setup["root"] / "target"),
            "--drafter",
            str(tmp_path / "nothing"),
            "--prompts",
            str(prompts),
        ]
    )
    assert code == 2 and "is not an exported drafter" in capsys.readouterr().err
