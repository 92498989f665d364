"""`train` refuses data prepared with another chat template or thinking mode than it serves (docs/method.md#data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import train as train_cli
from trainer.core.config import TrainerInputError, parse_train_args
from trainer.data import prepare as prepare_cli
from trainer.data.tiny_world import WalkWorld, build_tiny_target
from trainer.data.tokenizer_utils import build_tiny_tokenizer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(target dir with its tokenizer, dataset prepared with thinking off, another tokenizer with another template)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("check")
    world = WalkWorld(num_words=24, answer_words=8)
    tokenizer = build_tiny_tokenizer(world.texts(), root / "tok", vocab_size=320)
    target = root / "model"
    build_tiny_target(target, tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in world.conversations(4, seed=1)))
    data = root / "ds"
    assert (
        prepare_cli.main(
            [
                "--target-model",
                str(target),
                "--input",
                str(source),
                "--output-dir",
                str(data),
                "--enable-thinking",
                "off",
            ]
        )
        == 0
    )
    other = build_tiny_tokenizer(world.texts(), root / "other", vocab_size=320)
    other.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    other.save_pretrained(root / "other")
    return target, data, root / "other"


def argv(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    mask_id = 300
    return [
        "--target-model",
        str(target),
        "--data-dir",
        str(data),
        "--output-dir",
        str(out),
        "--num-draft-layers",
        "2",
        "--mask-token-id",
        str(mask_id),
        "--block-size",
        "4",
        "--max-seq-len",
        "64",
        "--token-budget",
        "256",
        "--wandb",
        "off",
        "--resume",
        "never",
        "--rope-theta",
        "10000",
        *extra,
    ]


def test_matching_settings_are_checked_and_pass(prepared, tmp_path, monkeypatch) -> None:
    target, data, _ = prepared
    compared = []
    real = prepare_cli.check_dataset_matches

    def spy(meta, tokenizer, enable_thinking):
        compared.append((meta.enable_thinking, enable_thinking))
        real(meta, tokenizer, enable_thinking)

    monkeypatch.setattr(prepare_cli, "check_dataset_matches", spy)
    out = tmp_path / "run"
    setup = train_cli.preflight(parse_train_args(argv(target, data, out, "--enable-thinking", "off")))
    assert compared == [(False, False)]  # the chat template and thinking mode were compared, not skipped
    assert setup.dataset.meta.chat_template_sha256 and setup.total_steps >= 1
    assert not out.exists()  # pre-flight reads, never writes


@pytest.mark.parametrize(
    "extra, words", [(["--enable-thinking", "on"], "enable_thinking"), (["--tokenizer", "OTHER"], "chat template")]
)
def test_mismatch_is_refused_before_anything_is_written(prepared, tmp_path, capsys, extra, words) -> None:
    target, data, other = prepared
    extra = [str(other) if e == "OTHER" else e for e in extra]
    out = tmp_path / "run"
    assert train_cli.main(argv(target, data, out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and "hint:" in err
    assert not out.exists()


def test_unloadable_tokenizer_is_a_clear_error(prepared, tmp_path) -> None:
    target, data, _ = prepared
    with pytest.raises(TrainerInputError, match="--tokenizer"):
        train_cli.preflight(
            parse_train_args(argv(target, data, tmp_path / "run", "--tokenizer", str(tmp_path / "none")))
        )
