"""`train --feature-cache DIR`: each sample's taps computed once, then read back; the training is the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import train
from trainer.data import prepare
from trainer.data.tiny_world import WalkWorld, build_tiny_target
from trainer.data.tokenizer_utils import MASK_TOKEN, build_tiny_tokenizer
from trainer.model.target import TargetModel

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def world_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fcache")
    world = WalkWorld(num_words=24, answer_words=8)
    tokenizer = build_tiny_tokenizer(world.texts(), root / "tok", vocab_size=320)
    build_tiny_target(root / "model", tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    source = root / "prompts.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in world.conversations(24, seed=3)))
    assert (
        prepare.main(
            ["--target-model", str(root / "model"), "--input", str(source), "--output-dir", str(root / "data")]
        )
        == 0
    )
    return root / "model", root / "data", int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))


def run(dirs: tuple[Path, Path, int], out: Path, *extra: str) -> list[dict]:
    model, data, mask_id = dirs
    argv = [
        *("--target-model", str(model), "--data-dir", str(data), "--output-dir", str(out)),
        *("--num-draft-layers", "2", "--mask-token-id", str(mask_id), "--block-size", "4", "--gamma", "2"),
        *("--max-seq-len", "64", "--token-budget", "256", "--max-batch-size", "4", "--anchors-per-seq", "4"),
        *("--max-anchors", "16", "--epochs", "2", "--max-steps", "8", "--log-interval", "1", "--wandb", "off"),
        *("--rope-theta", "10000", "--max-position-embeddings", "512", "--save-interval", "1000"),
        *extra,
    ]
    assert train.main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cached_taps_train_exactly_as_computed_ones_and_skip_the_target(
    world_dirs: tuple[Path, Path, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real = TargetModel.features

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "features", counted)
    plain = run(world_dirs, tmp_path / "plain")
    computed = calls["n"]
    cache = tmp_path / "cache"
    filling = run(world_dirs, tmp_path / "fill", "--feature-cache", str(cache))
    assert calls["n"] - computed < computed  # the second epoch read what the first one stored
    before = calls["n"]
    reading = run(world_dirs, tmp_path / "read", "--feature-cache", str(cache))
    assert calls["n"] == before  # every batch from the cache: the target never ran
    (key_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    assert len(list(key_dir.glob("*.npy"))) == 24 and (key_dir / "key.json").exists()
    for a, b, c in zip(plain, filling, reading):
        assert a["step"] == b["step"] == c["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) == pytest.approx(c["loss"], rel=1e-6)


def test_a_cut_cache_file_is_computed_again(world_dirs: tuple[Path, Path, int], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = run(world_dirs, tmp_path / "a", "--feature-cache", str(cache))
    (key_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    victim = sorted(key_dir.glob("*.npy"))[0]
    victim.write_bytes(
        victim.read_bytes()[:40]
    )  # a file cut short (a kill before the rename cannot do this; a disk can)
    again = run(world_dirs, tmp_path / "b", "--feature-cache", str(cache))
    assert [m["loss"] for m in first] == pytest.approx([m["loss"] for m in again], rel=1e-6)


def test_the_cache_refuses_soft_labels_and_the_pipeline(
    world_dirs: tuple[Path, Path, int], tmp_path: Path, capsys
) -> None:
    model, data, mask_id = world_dirs
    common = [
        "--target-model",
        str(model),
        "--data-dir",
        str(data),
        "--mask-token-id",
        str(mask_id),
        "--feature-cache",
        "x",
    ]
    assert train.main([*common, "--output-dir", str(tmp_path / "s"), "--use-soft-labels"]) == 2
    assert "--feature-cache" in capsys.readouterr().err
    assert train.main([*common, "--output-dir", str(tmp_path / "p"), "--pipeline"]) == 2
    assert "single-process engine" in capsys.readouterr().err
    assert not (tmp_path / "s").exists() and not (tmp_path / "p").exists()


def test_the_key_outlives_a_rerun_of_prepare_and_follows_the_data(tmp_path: Path) -> None:
    """`make demo-real` prepares its cached dataset again on every run, from a prompts file in its new work
    directory: prepare finds every shard complete and rewrites meta.json with that path. The key must not change
    then (it did: every demo filled the cache from nothing), and must change when the samples do."""
    from trainer.training.feature_cache import cache_key

    world = WalkWorld(num_words=24, answer_words=8)
    tokenizer = build_tiny_tokenizer(world.texts(), tmp_path / "tok", vocab_size=320)
    model = tmp_path / "model"
    build_tiny_target(model, tokenizer, hidden_size=32, num_layers=2, num_heads=1, num_kv_heads=1)
    rows = "".join(json.dumps({"messages": c}) + "\n" for c in world.conversations(6, seed=4))
    data = tmp_path / "data"

    def prepared(prompts: Path) -> str:
        assert prepare.main(["--target-model", str(model), "--input", str(prompts), "--output-dir", str(data)]) == 0
        return cache_key(model, [0, 1], data, 64, "float32")

    (tmp_path / "run1").mkdir(), (tmp_path / "run2").mkdir()
    (tmp_path / "run1" / "p.jsonl").write_text(rows)
    (tmp_path / "run2" / "p.jsonl").write_text(rows)
    first = prepared(tmp_path / "run1" / "p.jsonl")
    meta = (data / "meta.json").read_text()
    assert prepared(tmp_path / "run2" / "p.jsonl") == first
    assert (data / "meta.json").read_text() != meta  # the rerun did rewrite meta.json (the case this is about)
    for path in data.iterdir():
        path.unlink()
    (tmp_path / "run2" / "p.jsonl").write_text(rows.replace("north", "south"))
    assert prepared(tmp_path / "run2" / "p.jsonl") != first  # other samples in the same directory: another key
