"""prepare / inspect / tokenizer_utils on a real BPE tokenizer and a real tiny Qwen3 target (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data import inspect as inspect_cli
from trainer.data import prepare as prepare_cli
from trainer.data.shards import ShardedDataset, read_meta
from trainer.data.tiny_world import WalkWorld, build_tiny_target
from trainer.data.tokenizer_utils import (
    build_tiny_tokenizer,
    chat_template_sha256,
    tokenize_conversation,
    tokenize_prompt,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world() -> WalkWorld:
    return WalkWorld(num_words=24, answer_words=8)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, world) -> Path:
    """A hub-like model directory: random tiny Qwen3 + BPE tokenizer with a Qwen3-like chat template."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("target")
    tokenizer = build_tiny_tokenizer(world.texts(), root / "tok", vocab_size=320)
    build_tiny_target(root / "model", tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    return root / "model"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_padding_id_falls_back_to_the_end_of_turn_when_the_tokenizer_names_no_pad(target_dir):
    # transformers 5.17 converts SmolLM2's GGUF file with no pad token (5.25 names <|im_end|>): every batch that
    # pads must still get an id, the same one under both.
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from trainer.data.tokenizer_utils import DataInputError, end_of_turn_ids, padding_id

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert padding_id(tokenizer) == tokenizer.pad_token_id != end_of_turn_ids(tokenizer)[0]
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None and padding_id(tokenizer) == end_of_turn_ids(tokenizer)[0]

    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    )
    with pytest.raises(DataInputError, match="neither a pad token nor an end of turn"):
        padding_id(bare)


def test_loss_mask_covers_assistant_content_and_end_of_turn_only(target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    messages = [
        {"role": "system", "content": "walk well"},
        {"role": "user", "content": "walk north from bop"},
        {"role": "assistant", "content": "bop bon feb"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "feb bug ."},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages, enable_thinking=False)
    supervised = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert supervised == "bop bon feb<|im_end|>feb bug .<|im_end|>"
    assert "<think>" in tokenizer.decode(ids)  # thinking off: empty think block in the last turn, unsupervised
    on = tokenize_prompt(tokenizer, messages[:2], enable_thinking=True)
    off = tokenize_prompt(tokenizer, messages[:2], enable_thinking=False)
    assert tokenizer.decode(off).endswith("<think>\n\n</think>\n\n") and not tokenizer.decode(on).endswith(
        "</think>\n\n"
    )


def test_prepare_dataset_answers_with_shards_meta_and_inspect(target_dir, world, tmp_path, capsys):
    conversations = world.conversations(5, seed=1)
    source = write_jsonl(
        tmp_path / "in.jsonl",
        [{"messages": c} for c in conversations[:4]] + [{"prompt": "walk east from x", "response": "x y ."}],
    )
    out = tmp_path / "ds"
    assert (
        prepare_cli.main(
            [
                "--target-model",
                str(target_dir),
                "--input",
                str(source),
                "--output-dir",
                str(out),
                "--shard-size",
                "2",
                "--enable-thinking",
                "off",
                "--num-workers",
                "2",
            ]
        )
        == 0
    )
    dataset = ShardedDataset(out)
    assert len(dataset) == 5 and sorted(p.name for p in out.glob("*.offsets.npy")) == [
        f"shard-0000{i}.offsets.npy" for i in range(3)
    ]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    for i, conversation in enumerate(conversations[:4]):
        ids, mask = tokenize_conversation(tokenizer, conversation, False)
        assert dataset[i].input_ids.tolist() == ids and dataset[i].loss_mask.tolist() == mask
    meta = read_meta(out)
    assert meta.chat_template_sha256 == chat_template_sha256(tokenizer) and meta.enable_thinking is False
    assert meta.regenerated is False and meta.num_samples == 5
    assert inspect_cli.main([str(out), "--sample", "4"]) == 0
    report = capsys.readouterr().out
    assert "samples            5" in report and "[[x y .<|im_end|>]]" in report and "length histogram" in report


def test_regenerate_uses_target_greedy_answer(target_dir, world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conversations = world.conversations(3, seed=2)
    rows = [
        {"messages": conversations[0]},
        {"messages": conversations[1][:1]},
        {"prompt": conversations[2][0]["content"]},
    ]
    out = tmp_path / "regen"
    assert (
        prepare_cli.main(
            [
                "--target-model",
                str(target_dir),
                "--input",
                str(write_jsonl(tmp_path / "p.jsonl", rows)),
                "--output-dir",
                str(out),
                "--regenerate",
                "--max-new-tokens",
                "12",
                "--batch-size",
                "2",
                "--enable-thinking",
                "off",
            ]
        )
        == 0
    )
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    dataset = ShardedDataset(out)
    for i, conversation in enumerate(conversations):
        prompt = tokenize_prompt(tokenizer, conversation[:1], False)
        expected = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt) :].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        sample = dataset[i]
        assert sample.input_ids.tolist() == prompt + expected
        assert sample.loss_mask.tolist() == [0] * len(prompt) + [1] * len(expected)
    meta = read_meta(out)
    assert meta.regenerated and meta.enable_thinking is False and meta.extra["options"]["max_new_tokens"] == 12


def test_interrupted_regeneration_resumes_without_duplicates(target_dir, world, tmp_path):
    conversations = world.conversations(16, seed=3)
    source = write_jsonl(tmp_path / "p.jsonl", [{"messages": c[:1]} for c in conversations])
    out = tmp_path / "resume"
    argv = [
        "--target-model",
        str(target_dir),
        "--input",
        str(source),
        "--output-dir",
        str(out),
        "--regenerate",
        "--max-new-tokens",
        "24",
        "--shard-size",
        "2",
        "--batch-size",
        "1",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # A real process killed (SIGKILL: no cleanup) as soon as its first shard is on disk.
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.data.prepare", *argv],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    first = out / "shard-00000.offsets.npy"
    deadline = time.monotonic() + 60
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert first.exists(), process.stderr.read().decode()
    assert not (out / "meta.json").exists(), "prepare finished before it could be interrupted"
    done_before = len(list(out.glob("*.offsets.npy")))
    assert 1 <= done_before < 8
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.offsets.npy")}
    assert prepare_cli.main(argv) == 0
    assert all((out / name).stat().st_mtime_ns == stamp for name, stamp in stamps.items())  # complete shards skipped
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dataset = ShardedDataset(out)
    assert len(dataset) == 16
    for i, conversation in enumerate(conversations):  # every prompt exactly once, in input order
        prompt = tokenize_prompt(tokenizer, conversation[:1], None)
        assert dataset[i].input_ids[: len(prompt)].tolist() == prompt and dataset[i].loss_mask[len(prompt) :].all()


def test_regeneration_in_two_processes_writes_the_same_dataset(target_dir, world, tmp_path):
    """--num-workers 2 with --regenerate: two real spawned processes take whole shards (`make demo-real` answers its
    prompts so); each shard's batches and seed are one process's, so the shards are the same byte for byte."""
    from trainer.data import regenerate

    source = write_jsonl(tmp_path / "p.jsonl", [{"messages": c[:1]} for c in world.conversations(8, seed=5)])

    def argv(out: str, workers: int) -> list[str]:
        return [
            *("--target-model", str(target_dir), "--input", str(source), "--output-dir", str(tmp_path / out)),
            *("--regenerate", "--max-new-tokens", "12", "--shard-size", "2", "--batch-size", "2"),
            *("--num-workers", str(workers)),
        ]

    torch.set_num_threads(regenerate.worker_threads(2))  # the workers' threads: the same float sums
    assert prepare_cli.main(argv("one", 1)) == 0 and prepare_cli.main(argv("two", 2)) == 0
    files = sorted(p.name for p in (tmp_path / "one").glob("shard-*"))
    assert len(files) == 12  # four shards of tokens, mask and offsets
    assert [(tmp_path / "two" / f).read_bytes() for f in files] == [(tmp_path / "one" / f).read_bytes() for f in files]
    assert ShardedDataset(tmp_path / "two")[7].loss_mask.any()  # the last shard's prompt was answered


def test_regeneration_workers_end_when_prepare_is_killed_alone(target_dir, world, tmp_path):
    """A SIGKILL to prepare's own pid (not its group: the OOM killer, `kill -9 PID`) must not leave its spawned
    regeneration workers waiting forever, each holding a copy of the target (trainer/core/parent_watch.py)."""
    import psutil

    source = write_jsonl(tmp_path / "p.jsonl", [{"messages": c[:1]} for c in world.conversations(40, seed=6)])
    argv = [
        *("--target-model", str(target_dir), "--input", str(source), "--output-dir", str(tmp_path / "out")),
        *("--regenerate", "--max-new-tokens", "24", "--shard-size", "1", "--batch-size", "1", "--num-workers", "2"),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.data.prepare", *argv],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    everyone: list[psutil.Process] = []
    try:
        parent, deadline = psutil.Process(process.pid), time.monotonic() + 60
        workers: list[psutil.Process] = []
        while len(workers) < 2 and process.poll() is None and time.monotonic() < deadline:
            workers = [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]
            time.sleep(0.05)
        assert len(workers) == 2, "the two workers did not start"
        everyone = parent.children(recursive=True)  # the workers and the pool's resource tracker
        process.kill()  # its pid alone
        process.wait()
        _, alive = psutil.wait_procs(everyone, timeout=15)
        assert alive == [], f"outlived their parent: {[p.cmdline() for p in alive]}"
    finally:  # nothing of this test's may outlive it, whatever failed above
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for leftover in everyone:
            if leftover.is_running():
                leftover.kill()


def run_prepare(capsys, *argv: str) -> tuple[int, str]:
    code = prepare_cli.main(list(argv))
    return code, capsys.readouterr().err


def test_malformed_line_reports_line_number_and_skip_bad(target_dir, world, tmp_path, capsys):
    good = {"messages": world.conversations(1, seed=4)[0]}
    source = write_jsonl(tmp_path / "bad.jsonl", [good, "{not json", good, {"text": "no prompt"}])
    out = tmp_path / "ds"
    code, err = run_prepare(capsys, "--target-model", str(target_dir), "--input", str(source), "--output-dir", str(out))
    assert code == 2 and f"{source}:2: malformed JSON" in err and "--skip-bad" in err and not out.exists()
    code, err = run_prepare(
        capsys, "--target-model", str(target_dir), "--input", str(source), "--output-dir", str(out), "--skip-bad"
    )
    assert code == 0 and "skipped 2 malformed line(s): 2, 4" in err
    assert len(ShardedDataset(out)) == 2 and read_meta(out).extra["skipped_lines"] == [2, 4]


def test_missing_assistant_turn_without_regenerate(target_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "walk north from bop"}])
    code, err = run_prepare(
        capsys, "--target-model", str(target_dir), "--input", str(source), "--output-dir", str(tmp_path / "o")
    )
    assert (
        code == 2
        and "record 1 has no assistant turn" in err
        and "--regenerate" in err
        and not (tmp_path / "o").exists()
    )


def test_tokenizer_without_chat_template(target_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    for leftover in (tmp_path / "plain").glob("chat_template.*"):
        leftover.unlink()
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "response": "b"}])
    code, err = run_prepare(
        capsys,
        "--target-model",
        str(target_dir),
        "--tokenizer",
        str(tmp_path / "plain"),
        "--input",
        str(source),
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert code == 2 and "the tokenizer has no chat template" in err and not (tmp_path / "o").exists()


def test_output_dir_holding_a_different_dataset_is_refused(target_dir, tmp_path, capsys):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "response": "b"}])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "c", "response": "d"}])
    out = tmp_path / "ds"
    assert (
        run_prepare(capsys, "--target-model", str(target_dir), "--input", str(first), "--output-dir", str(out))[0] == 0
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run_prepare(capsys, "--target-model", str(target_dir), "--input", str(second), "--output-dir", str(out))
    assert code == 2 and "already holds a different dataset (differs in: input_sha256)" in err
    code, err = run_prepare(
        capsys,
        "--target-model",
        str(target_dir),
        "--input",
        str(first),
        "--output-dir",
        str(out),
        "--enable-thinking",
        "on",
    )
    assert code == 2 and "enable_thinking" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing changed
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, err = run_prepare(
        capsys, "--target-model", str(target_dir), "--input", str(first), "--output-dir", str(foreign)
    )
    assert code == 2 and "holds no dataset made by prepare" in err and os.listdir(foreign) == ["notes.txt"]
    # The same job again is a no-op resume.
    code, err = run_prepare(capsys, "--target-model", str(target_dir), "--input", str(first), "--output-dir", str(out))
    assert code == 0 and "1 of 1 shard(s) already complete" in err


def test_regenerating_into_a_directory_with_another_targets_answers_is_refused(target_dir, world, tmp_path, capsys):
    """The answers are the target's own: a rerun with another target (the same shape and tokenizer, other weights)
    would mix two targets' answers in one dataset. The same target at another path is the same target."""
    import shutil

    from transformers import AutoTokenizer

    build_tiny_target(
        tmp_path / "other",
        AutoTokenizer.from_pretrained(target_dir),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        seed=1,
    )
    moved = tmp_path / "moved"
    shutil.copytree(target_dir, moved)
    source = write_jsonl(tmp_path / "p.jsonl", [{"messages": c[:1]} for c in world.conversations(4, seed=5)])
    out = tmp_path / "ds"
    flags = ["--input", str(source), "--output-dir", str(out), "--regenerate", "--max-new-tokens", "6"]
    flags += ["--shard-size", "2"]
    assert run_prepare(capsys, "--target-model", str(target_dir), *flags)[0] == 0
    (out / "shard-00001.offsets.npy").unlink()  # an interrupted run: its second shard is to be made again
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run_prepare(capsys, "--target-model", str(tmp_path / "other"), *flags)
    assert code == 2 and "already holds a different dataset (differs in: target)" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing changed
    code, err = run_prepare(capsys, "--target-model", str(moved), *flags)
    assert code == 0 and "resuming: 1 of 2 shard(s) already complete" in err, err


def test_a_dataset_prepared_before_the_target_was_fingerprinted_still_resumes(target_dir, world, tmp_path, capsys):
    source = write_jsonl(tmp_path / "p.jsonl", [{"messages": c[:1]} for c in world.conversations(2, seed=6)])
    out = tmp_path / "ds"
    flags = ["--target-model", str(target_dir), "--input", str(source), "--output-dir", str(out), "--regenerate"]
    flags += ["--max-new-tokens", "6"]
    assert run_prepare(capsys, *flags)[0] == 0
    manifest = json.loads((out / "prepare.json").read_text())
    assert len(manifest.pop("target")) == 64
    (out / "prepare.json").write_text(json.dumps(manifest))  # as prepare wrote it before
    code, err = run_prepare(capsys, *flags)
    assert code == 0 and "already complete" in err, err


def test_inspect_of_a_directory_without_dataset(tmp_path, capsys):
    assert inspect_cli.main([str(tmp_path)]) == 2
    assert "is not a prepared dataset" in capsys.readouterr().err


def test_length_histogram_counts_every_sample():
    lines = inspect_cli.length_histogram(np.array([3, 3, 4, 10, 17]), bins=4)
    assert sum(int(line.split()[1]) for line in lines) == 5


def test_check_dataset_matches_template_and_thinking(target_dir):
    from transformers import AutoTokenizer

    from trainer.data.shards import DatasetMeta

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    meta = DatasetMeta(chat_template_sha256=chat_template_sha256(tokenizer), enable_thinking=False)
    prepare_cli.check_dataset_matches(meta, tokenizer, False)
    with pytest.raises(prepare_cli.DataInputError, match="enable_thinking=False"):
        prepare_cli.check_dataset_matches(meta, tokenizer, True)
    with pytest.raises(prepare_cli.DataInputError, match="chat template sha256"):
        prepare_cli.check_dataset_matches(DatasetMeta(chat_template_sha256="0" * 64), tokenizer, None)
