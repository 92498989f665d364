"""`dflashops fetch` on the local target: what it brings, sha256 against the target's files, a partial
continued (not restarted), a corrupt partial refused, `--export` through the trainer's real exporter, and
bad input refused before anything is written. (Cuts on a real link: tests/remote/test_fetch_remote.py.)"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from tests.controller.helpers import Env

CKPT_BYTES = 3_000_000


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def finished_run(env: Env, capsys: pytest.CaptureFixture[str], name: str, *extra: str) -> Path:
    code, _, err = env.cli(
        "deploy",
        "--detach",
        "--profile",
        "work",
        "--name",
        name,
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "6",
        "--interval",
        "0",
        "--save-every",
        "3",
        "--ckpt-bytes",
        str(CKPT_BYTES),
        *extra,
        capsys=capsys,
    )
    assert code == 0, err
    code, _, err = env.cli("logs", name, "-f", "--timeout", "60", capsys=capsys)
    assert code == 0, err
    return env.runs / name


def test_fetch_brings_verified_files_and_skips_what_is_there(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = finished_run(env, capsys, "f1")
    dest = tmp_path / "here"
    code, out, err = env.cli(
        "fetch", "f1", "--checkpoint", "latest", "--logs", "--to", str(dest), "--json", capsys=capsys
    )
    assert code == 0, err
    result = json.loads(out)
    got = {f["path"]: f for f in result["files"]}
    assert set(got) == {
        "run.json",
        "status.json",
        "metrics.jsonl",
        "exit_code",
        "train.log",
        "checkpoints/step_000006/model.bin",
        "checkpoints/step_000006/state.json",
    }
    for rel, item in got.items():
        assert item["how"] == "fetched" and sha(dest / rel) == sha(run / rel) == item["sha256"], rel
    assert result["bytes_sent"] == result["bytes_total"] >= CKPT_BYTES
    assert not list(dest.rglob(".*partial*"))  # nothing left but final names
    assert "every file matches its sha256" in err
    # the rate in a unit that keeps its digits (a ~3 MB fetch said `0 MiB/s` when it took over a second)
    rate = re.search(rf"{result['bytes_sent']:,} bytes sent in \d+\.\d s, (\d+(?:\.\d)?) (B|KiB|MiB|GiB)/s\)", err)
    assert rate and float(rate.group(1)) >= 1, err

    code, out, err = env.cli(
        "fetch", "f1", "--checkpoint", "latest", "--logs", "--to", str(dest), "--json", capsys=capsys
    )
    again = json.loads(out)
    assert code == 0 and again["bytes_sent"] == 0 and {f["how"] for f in again["files"]} == {"unchanged"}
    assert "7 unchanged; nothing sent); every file matches its sha256" in err and "MiB/s" not in err

    code, out, _ = env.cli("fetch", "f1", "--checkpoint", "3", "--to", str(dest), capsys=capsys)
    assert code == 0 and out.strip() == str(dest)
    assert sha(dest / "checkpoints/step_000003/model.bin") == sha(run / "checkpoints/step_000003/model.bin")
    assert not (dest / "train.log.1").exists()


def test_a_partial_is_continued_and_a_corrupt_one_refused(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = finished_run(env, capsys, "f2")
    source = run / "checkpoints/step_000006/model.bin"
    dest = tmp_path / "here"
    target_dir = dest / "checkpoints/step_000006"
    target_dir.mkdir(parents=True)
    half = CKPT_BYTES // 2
    # What a cut fetch leaves behind: the first half under the hidden partial name, with its record.
    (target_dir / ".model.bin.partial").write_bytes(source.read_bytes()[:half])
    (target_dir / ".model.bin.partial.json").write_text(json.dumps({"sha256": sha(source)}))
    code, out, err = env.cli("fetch", "f2", "--to", str(dest), "--json", capsys=capsys)
    assert code == 0, err
    model = next(f for f in json.loads(out)["files"] if f["path"].endswith("model.bin"))
    assert model["how"] == "resumed" and model["sent"] == CKPT_BYTES - half
    assert sha(target_dir / "model.bin") == sha(source)

    (target_dir / "model.bin").unlink()
    corrupt = bytearray(source.read_bytes()[:half])
    corrupt[10] ^= 0xFF
    (target_dir / ".model.bin.partial").write_bytes(bytes(corrupt))
    (target_dir / ".model.bin.partial.json").write_text(json.dumps({"sha256": sha(source)}))
    code, out, err = env.cli("fetch", "f2", "--to", str(dest), capsys=capsys)
    assert code == 1 and "model.bin: sha256 of the fetched bytes does not match" in err and "\nhint: " in err
    assert not (target_dir / "model.bin").exists() and not (target_dir / ".model.bin.partial").exists()
    code, _, err = env.cli("fetch", "f2", "--to", str(dest), capsys=capsys)  # the next fetch starts clean
    assert code == 0 and sha(target_dir / "model.bin") == sha(source)


def test_export_runs_the_trainer_exporter_on_the_target(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.trainer.test_export import save_training_checkpoint
    from tests.trainer.tiny import build_tiny_target, tiny_drafter_config
    from trainer.model.drafter import DFlashDrafter

    env.inventory.write_text(env.inventory.read_text().replace("    packages: []\n", ""))  # ship trainer/
    code, _, err = env.cli(
        "deploy",
        "--detach",
        "--profile",
        "work",
        "--name",
        "ex1",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "2",
        "--interval",
        "0",
        capsys=capsys,
    )
    assert code == 0, err
    assert env.cli("logs", "ex1", "-f", "--timeout", "60", capsys=capsys)[0] == 0
    model = DFlashDrafter(tiny_drafter_config(build_tiny_target(), num_hidden_layers=1, block_size=4))
    save_training_checkpoint(env.runs / "ex1", model, step=5)  # a real training checkpoint in the run
    dest = tmp_path / "out"
    code, out, err = env.cli("fetch", "ex1", "--export", "--dry-run", "--to", str(dest), capsys=capsys)
    assert code == 0 and "-m trainer export" in out and "PYTHONPATH=" in out and not dest.exists()
    assert not (env.runs / "ex1" / "export").exists()
    code, out, err = env.cli("fetch", "ex1", "--export", "--to", str(dest), capsys=capsys)
    assert code == 0, err
    assert sorted(p.name for p in (dest / "export/step_000005").iterdir()) == ["config.json", "model.safetensors"]
    assert not (dest / "checkpoints").exists()  # the export instead of the raw checkpoint
    code, _, err = env.cli("fetch", "ex1", "--export", "--to", str(dest), capsys=capsys)
    assert code == 0 and "export export/step_000005 exists on local" in err  # made once, reused

    # --format speculators: the run's recorded target model gives the embedding, LM head and final norm
    from tests.trainer.test_export_speculators import checkpoint

    target = build_tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    checkpoint(env.runs / "ex1", model, tmp_path / "target", step=6)  # with the run's config, as the trainer saves
    code, out, err = env.cli("fetch", "ex1", "--export", "--format", "speculators", "--to", str(dest), capsys=capsys)
    assert code == 0, err
    assert "exporting step_000006 (speculators format)" in err
    spec = dest / "export/step_000006-speculators"
    assert sorted(p.name for p in spec.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((spec / "config.json").read_text())["aux_hidden_state_layer_ids"] == [1, 2]  # taps [0, 1] + 1
    code, _, err = env.cli("fetch", "ex1", "--format", "speculators", capsys=capsys)
    assert code == 2 and "--format chooses the export's format: it needs --export" in err


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["fetch", "f3", "--checkpoint", "soon"], 2, "error: --checkpoint takes `latest` or a step number"),
        (["fetch", "f3", "--checkpoint", "99"], 3, "error: run 'f3' has no checkpoint at step 99"),
        (["fetch", "nosuch"], 3, "error: local: run 'nosuch' does not exist"),
        (["fetch", "a;b"], 2, "error: invalid run name"),
    ],
)
def test_bad_input_changes_nothing(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], code: int, message: str
) -> None:
    finished_run(env, capsys, "f3")
    dest = tmp_path / "dest"
    got, out, err = env.cli(*argv, "--to", str(dest), capsys=capsys)
    assert (got, out) == (code, "") and err.startswith(message) and "\nhint: " in err, err
    assert not dest.exists()


def test_a_run_without_checkpoints(env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, _ = env.cli(
        "deploy",
        "--detach",
        "--profile",
        "work",
        "--name",
        "f4",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "2",
        "--interval",
        "0",
        capsys=capsys,
    )
    assert code == 0 and env.cli("logs", "f4", "-f", "--timeout", "60", capsys=capsys)[0] == 0
    got, out, err = env.cli("fetch", "f4", "--to", str(tmp_path / "d"), capsys=capsys)
    assert got == 3 and "error: run 'f4' has no checkpoint yet" in err and "--logs" in err
    got, out, err = env.cli("fetch", "f4", "--logs", "--to", str(tmp_path / "d"), capsys=capsys)
    assert got == 0 and (tmp_path / "d" / "train.log").is_file()
