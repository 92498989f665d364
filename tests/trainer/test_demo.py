"""The tiny end-to-end (`trainer demo --quick`): real target, regeneration, training, export, eval."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from trainer import demo
from trainer.data.shards import read_meta
from trainer.export.export import public_tensor_names


@pytest.mark.slow
def test_quick_demo_trained_drafter_beats_both_baselines_losslessly(tmp_path, capsys):
    workdir, run_dir = tmp_path / "demo", tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("")  # the run directory as dflashops' demo profile hands it over
    assert demo.main(["--workdir", str(workdir), "--quick", "--train-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "trained" in out and "untrained" in out and "ngram" in out
    assert out.splitlines()[-1].startswith("demo finished in "), out  # the line `dflashops status` shows last
    report = json.loads((workdir / "eval.json").read_text())
    assert report["lossless"] and all(m["lossless"] for m in report["methods"].values())
    taus = {name: m["tau"] for name, m in report["methods"].items()}
    assert taus["trained"] >= max(taus["untrained"], taus["ngram"]) + demo.QUICK.margin
    meta = read_meta(workdir / "data")
    assert meta.regenerated and meta.enable_thinking is False and meta.num_samples == demo.QUICK.train_prompts
    config = json.loads((workdir / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["block_size"] == 8
    with safe_open(str(workdir / "export" / "model.safetensors"), "pt") as handle:
        assert sorted(handle.keys()) == sorted(public_tensor_names(2))
    # the training ran in the run directory given, so dflashops' status and runs show its step and loss there
    status = json.loads((run_dir / "status.json").read_text())
    assert status["step"] == demo.QUICK.train_steps and status["phase"] == "done", status
    assert (run_dir / "metrics.jsonl").read_text().count("\n") >= 1 and not (workdir / "run").exists()
    assert report["budget"]["blocks"] > 0  # counted from the run directory's metrics


def test_demo_refuses_a_non_empty_workdir(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep")
    assert demo.main(["--workdir", str(tmp_path), "--quick"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_held_out_prompts_never_occur_in_training():
    from trainer.data.tiny_world import WalkWorld

    train, held = demo.split_prompts(WalkWorld(num_words=40, answer_words=16), demo.FULL)
    assert len(held) == demo.FULL.eval_prompts and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
