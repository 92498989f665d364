"""Pure rules: `--name +` naming, secret redaction, argument-aware diffs, W&B naming."""

from __future__ import annotations

import pytest

from dflashops.core.errors import UsageError
from dflashops.lineage import RunRecord, diff_runs, next_name, parse_argv, redact_argv, redact_env, wandb_env
from dflashops.lineage.diff import FLAG_PRESENT


@pytest.mark.parametrize(
    ("parent", "taken", "expected"),
    [
        ("exp-ddtree-flex5", set(), "exp-ddtree-flex6"),
        ("execlock-v2", set(), "execlock-v3"),
        ("baseline", set(), "baseline-v2"),
        ("baseline", {"baseline-v2", "baseline-v3"}, "baseline-v4"),
        ("exp-flex5", {"exp-flex6"}, "exp-flex7"),
        ("run007", set(), "run008"),
        ("flex9", set(), "flex10"),
        ("run-2026", set(), "run-2026-v2"),  # a year is not a counter
        ("sweep_2026-11-29", set(), "sweep_2026-11-29-v2"),  # nor is a date
    ],
)
def test_next_name(parent: str, taken: set[str], expected: str) -> None:
    assert next_name(parent, taken) == expected


def test_next_name_refuses_bad_parent_and_overlong_result() -> None:
    with pytest.raises(UsageError):
        next_name("a;b", set())
    with pytest.raises(UsageError) as caught:
        next_name("x" * 64, set())  # x...x-v2 is 67 characters
    assert "derived run name" in caught.value.message


def test_redact_env() -> None:
    env = {
        "WANDB_API_KEY": "abc",
        "HF_TOKEN": "hf_abcdefghijkl",
        "GITHUB_PAT": "x",
        "DB_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "s",
        "OPENAI_KEY": "sk-proj-abcdefghijklmnopqrstuvwx",
        "S3_KEY": "AbCdEf0123456789ZzYy",
        "SOME_VAR": "hf_abcdefghijklmnop",
        "KEYMAP": "us",
        "SSH_KEY_PATH": "/root/.ssh/id_ed25519_deploy_key",
        "HF_HOME": "/cache/hf",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "PROXY": "http://bob:s3cret@proxy:3128",
    }
    out = redact_env(env)
    for key in (
        "WANDB_API_KEY",
        "HF_TOKEN",
        "GITHUB_PAT",
        "DB_PASSWORD",
        "AWS_SECRET_ACCESS_KEY",
        "OPENAI_KEY",
        "S3_KEY",
        "SOME_VAR",
    ):
        assert out[key] == "<redacted>", key
    for key in ("KEYMAP", "SSH_KEY_PATH", "HF_HOME", "PYTORCH_CUDA_ALLOC_CONF"):
        assert out[key] == env[key], key
    assert out["PROXY"] == "http://bob:<redacted>@proxy:3128"
    assert redact_env(out) == out  # idempotent


def test_redact_argv() -> None:
    argv = ["python", "--hf-token", "abc", "--api-key=xyz", "--lr", "1e-4", "hf_abcdefghijklmnop", "--password", "p"]
    assert redact_argv(argv) == [
        "python",
        "--hf-token",
        "<redacted>",
        "--api-key=<redacted>",
        "--lr",
        "1e-4",
        "<redacted>",
        "--password",
        "<redacted>",
    ]


def test_parse_argv_pairs_booleans_repeats_and_negatives() -> None:
    positional, options = parse_argv(
        [
            "python",
            "-m",
            "trainer",
            "train",
            "--lr",
            "1e-4",
            "--compile",
            "--shift=-1",
            "--bias",
            "-0.5",
            "--tap",
            "1",
            "--tap",
            "5",
            "-n",
            "3",
            "--",
            "--not-a-flag",
        ]
    )
    assert positional == ["python", "train", "--not-a-flag"]  # `-m trainer` is a short option with its value
    assert options == {
        "-m": "trainer",
        "--lr": "1e-4",
        "--compile": FLAG_PRESENT,
        "--shift": "-1",
        "--bias": "-0.5",
        "--tap": ["1", "5"],
        "-n": "3",
    }


def test_diff_runs_is_order_insensitive_and_pair_aware() -> None:
    a = RunRecord(
        name="a",
        argv=["t", "--lr", "1e-4", "--bs", "8", "--compile"],
        env={"X": "1", "Y": "2"},
        code_hash="1" * 40,
        profile="tiny",
    )
    same = RunRecord(
        name="same",
        argv=["t", "--compile", "--bs", "8", "--lr", "1e-4"],
        env={"Y": "2", "X": "1"},
        code_hash="1" * 40,
        profile="tiny",
    )
    assert diff_runs(a, same).empty and diff_runs(a, same).summary() == "no change"
    b = RunRecord(
        name="b",
        argv=["t", "--lr", "3e-4", "--bs", "8", "--warmup", "100"],
        env={"X": "1", "Z": "3"},
        code_hash="2" * 40,
        profile="qwen3-8b",
        target="ct200",
    )
    diff = diff_runs(a, b)
    assert diff.args_changed == {"--lr": ("1e-4", "3e-4")}
    assert diff.args_added == {"--warmup": "100"} and diff.args_removed == {"--compile": FLAG_PRESENT}
    assert diff.env_added == {"Z": "3"} and diff.env_removed == {"Y": "2"} and not diff.env_changed
    assert set(diff.fields_changed) == {"code_hash", "profile", "target"}
    lines = diff.lines()
    assert "~ --lr 1e-4 -> 3e-4" in lines and "+ --warmup 100" in lines and "- --compile (set)" in lines
    assert "~ code_hash: 111111111111 -> 222222222222" in lines
    assert diff.summary(limit=3).endswith("more")
    assert diff.to_dict()["args"]["changed"] == {"--lr": {"a": "1e-4", "b": "3e-4"}}


def test_wandb_env_mirrors_lineage() -> None:
    env = wandb_env("exp-flex7", "exp-flex6", "flex attention on", root="exp-flex5")
    assert env["WANDB_NAME"] == "exp-flex7" and env["WANDB_RUN_GROUP"] == "exp-flex5"
    assert env["DFLASHOPS_RUN_PARENT"] == "exp-flex6" and env["WANDB_NOTES"] == "flex attention on"
    assert "DFLASHOPS_RUN_PARENT" not in wandb_env("root", None, "", root="root")


def test_record_rejects_unknown_state() -> None:
    with pytest.raises(ValueError):
        RunRecord(name="x", state="exploded")


def test_diff_ignores_the_runs_own_name_hash_and_identity_env() -> None:
    a = RunRecord(
        name="exp-flex5",
        code_hash="a" * 40,
        argv=["py", f"/w/releases/{'a' * 40}/t.py", "--out", "/w/runs/exp-flex5"],
        env={"WANDB_NAME": "exp-flex5", "DFLASHOPS_RUN_PARENT": "x", "LOG": "/w/runs/exp-flex5/x.log"},
    )
    b = RunRecord(
        name="exp-flex6",
        code_hash="b" * 40,
        argv=["py", f"/w/releases/{'b' * 40}/t.py", "--out", "/w/runs/exp-flex6"],
        env={"WANDB_NAME": "exp-flex6", "DFLASHOPS_RUN_PARENT": "exp-flex5", "LOG": "/w/runs/exp-flex6/x.log"},
    )
    diff = diff_runs(a, b)
    assert diff.lines() == ["~ code_hash: aaaaaaaaaaaa -> bbbbbbbbbbbb"]
    # A longer name that merely starts with the run's name is not the run's name.
    c = RunRecord(name="exp-flex6", argv=["py", "--out", "/w/runs/exp-flex65"])
    assert diff_runs(RunRecord(name="exp-flex5", argv=["py", "--out", "/w/runs/exp-flex55"]), c).args_changed
