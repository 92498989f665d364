"""eval: speculative decoding against a real tiny Qwen3 target; lossless, tau bookkeeping, baselines, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import eval as eval_cli
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import TargetModel
from trainer.tiny_world import WalkWorld, build_tiny_target
from trainer.tokenizer_utils import MASK_TOKEN, build_tiny_tokenizer, end_of_turn_ids, tokenize_prompt


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("eval")
    world = WalkWorld(num_words=24, answer_words=8)
    tokenizer = build_tiny_tokenizer(world.texts(), root / "tok", vocab_size=320)
    model = build_tiny_target(root / "target", tokenizer, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    torch.manual_seed(0)
    config = DrafterConfig.for_target(model.config, num_hidden_layers=2, block_size=4,
                                      mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    prompts = [tokenize_prompt(tokenizer, c[:1], False) for c in world.conversations(3, seed=5)]
    return {"root": root, "tokenizer": tokenizer, "model": model, "drafter": DFlashDrafter(config).eval(),
            "prompts": prompts, "stops": end_of_turn_ids(tokenizer)}


def test_oracle_proposer_accepts_whole_blocks_and_garbage_accepts_nothing(setup):
    model, prompt, stops = setup["model"], setup["prompts"][0], setup["stops"]
    reference = eval_cli.greedy_reference(model, prompt, 20, stops, 0)
    runner = eval_cli.TargetRunner(model, [1, 2])

    def oracle(committed, taps, slots):
        done = len(committed) - len(prompt)
        return reference[done:done + slots]

    stats = eval_cli.MethodStats("oracle")
    output = eval_cli.speculative_generate(runner, prompt, oracle, slots=3, max_new_tokens=20, stops=set(stops), stats=stats)
    assert output == reference
    # 1 token from the prefill, then 4 per step (3 accepted + bonus) until the length limit.
    assert stats.steps == -(-(len(reference) - 1) // 4) and stats.slot_accepted[0] == stats.slot_proposed[0]
    garbage = eval_cli.MethodStats("garbage")

    def wrong(committed, taps, slots):
        return [(t + 1) % 300 for t in reference[len(committed) - len(prompt):][:slots]]

    assert eval_cli.speculative_generate(runner, prompt, wrong, slots=3, max_new_tokens=20, stops=set(stops), stats=garbage) == reference
    assert garbage.summary()["tau"] == 1.0 and garbage.steps == len(reference) - 1


def test_runner_taps_match_the_training_target_features(setup):
    model, prompt = setup["model"], setup["prompts"][1]
    runner = eval_cli.TargetRunner(model, [1, 2])
    _, first = runner.forward(prompt[:5])
    _, rest = runner.forward(prompt[5:])  # incremental, through the KV cache
    features = TargetModel(model, [1, 2]).features(torch.tensor([prompt])).taps[0]
    assert torch.allclose(torch.cat([first, rest]), features, atol=1e-5)


def test_evaluate_reports_all_methods_lossless(setup):
    report = eval_cli.evaluate(setup["model"], setup["drafter"], setup["prompts"], max_new_tokens=16,
                               stops=setup["stops"], pad_id=0)
    assert set(report["methods"]) == {"trained", "untrained", "ngram"} and report["lossless"]
    for method in report["methods"].values():
        assert method["tau"] >= 1.0 and len(method["per_slot_acceptance"]) == 3
        assert method["tokens_per_target_forward"] > 0
    table = eval_cli.format_table(report)
    assert "trained" in table and "ngram" in table


def test_ngram_proposer_copies_what_followed_the_last_match():
    propose = eval_cli.ngram_proposer(max_ngram=2)
    assert propose([5, 6, 7, 8, 1, 6, 7], torch.empty(0), 3) == [8, 1, 6]
    assert propose([1, 2, 3], torch.empty(0), 3) == []


def test_drafter_that_does_not_fit_the_target_is_refused(setup):
    config = setup["drafter"].config
    too_deep = DrafterConfig(**{**config.__dict__, "target_layer_ids": [1, 7], "num_target_layers": 8})
    with pytest.raises(eval_cli.DataInputError, match="target has 4 layers but the drafter taps"):
        eval_cli.evaluate(setup["model"], DFlashDrafter(too_deep), setup["prompts"], max_new_tokens=4, stops=setup["stops"], pad_id=0)
    wide = DrafterConfig(**{**config.__dict__, "hidden_size": 48})
    with pytest.raises(eval_cli.DataInputError, match="hidden_size 48 != target hidden size 32"):
        eval_cli.evaluate(setup["model"], DFlashDrafter(wide), setup["prompts"], max_new_tokens=4, stops=setup["stops"], pad_id=0)
    with pytest.raises(eval_cli.DataInputError, match="--block-size 9 must be in 2..4"):
        eval_cli.evaluate(setup["model"], setup["drafter"], setup["prompts"], max_new_tokens=4, block_size=9,
                          stops=setup["stops"], pad_id=0)


def test_eval_cli_end_to_end(setup, tmp_path, capsys):
    setup["drafter"].save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "walk north from bop"}\n{"messages": [{"role": "user", "content": "walk east"}]}\n')
    code = eval_cli.main(["--target-model", str(setup["root"] / "target"), "--drafter", str(tmp_path / "drafter"),
                          "--prompts", str(prompts), "--max-new-tokens", "8", "--enable-thinking", "off",
                          "--json", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["prompts"] == 2 and report["lossless"] and json.loads((tmp_path / "r.json").read_text()) == report
    assert "per-slot acceptance" in captured.err
    code = eval_cli.main(["--target-model", str(setup["root"] / "target"), "--drafter", str(tmp_path / "nothing"),
                          "--prompts", str(prompts)])
    assert code == 2 and "is not an exported drafter" in capsys.readouterr().err
