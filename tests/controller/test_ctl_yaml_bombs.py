"""Hostile or broken YAML files (issue 15, item 16): a 639-byte "billion laughs" inventory, a 10 MB file,
invalid UTF-8 and 50,000-deep nesting each get one `FILE:LINE:` error and a hint, quickly, from a real
dflashops process whose memory is capped (so a regression fails on its MemoryError instead of eating the
machine). Normal aliases keep working. Playbooks go through the same reader."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from dflashops.core.inventory import load_inventory
from tests.controller.helpers import REPO, Env

MEMORY_CAP = 1 << 30  # 1 GiB of address space: the billion-laughs file needed 3.4 GB before the fix


def billion_laughs(prefix: str = "") -> str:
    """Nine levels of nine aliases each (9^9 strings once expanded), as a key and as values."""
    lines = [f'{prefix}a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{prefix}{name}: &{name} [{','.join(['*' + previous] * 9)}]")
    return "\n".join(lines) + "\n"


BAD_FILES = {
    # name: (file bytes, line the error names, words the error has)
    "laughs_as_values": (
        (billion_laughs() + "targets:\n  local: {kind: local, workspace: ws, gpus: *i}\n").encode(),
        None,
        "aliases expand to more than",
    ),
    "laughs_as_a_key": (
        (
            "targets:\n  local: {kind: local, workspace: ws}\nprofiles:\n  p:\n    argv: [x]\n"
            "    env:\n" + billion_laughs("      K") + "      ? *Ki\n      : boom\n"
        ).encode(),
        None,
        "aliases expand to more than",
    ),
    "deep": (b"targets: " + b"[" * 50_000 + b"]" * 50_000 + b"\n", 1, "nested more than 64 levels"),
    "not_utf8": (
        b'targets:\n  local: {kind: local, workspace: "w\xff\xfes"}\n',
        2,
        "not UTF-8 text (byte 0xff at column 37)",
    ),
    "ten_megabytes": (
        b"targets:\n  local: {kind: local, workspace: ws}\n# " + b"x" * 10_000_000 + b"\n",
        None,
        "more than the 1 MiB",
    ),
    "self_alias": (b"targets: &t\n  local: *t\n", 2, "refers to itself"),
}


def limited_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "dflashops.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=cwd,
        preexec_fn=cap,
    )


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_item16_hostile_inventories_get_one_error_line(tmp_path: Path, case: str) -> None:
    data, line, words = BAD_FILES[case]
    inventory = tmp_path / "inventory.yaml"
    inventory.write_bytes(data)
    result = limited_cli("--inventory", str(inventory), "status", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert [entry.split(":")[0] for entry in lines] == ["error", "hint"], lines
    assert lines[0].startswith(f"error: {inventory}{':' + str(line) if line else ''}:") and words in lines[0], lines
    assert not (tmp_path / "lineage.sqlite").exists()


@pytest.mark.parametrize("case", ["laughs_as_values", "deep", "not_utf8"])
def test_item16_hostile_playbooks_get_one_error_line(env: Env, case: str) -> None:
    data = BAD_FILES[case][0].replace(b"targets", b"steps")
    playbook = env.root / "bomb.yaml"
    playbook.write_bytes(data)
    result = limited_cli(
        "--inventory", str(env.inventory), "play", str(playbook), "--target", "local", "--check", cwd=env.root
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and str(playbook) in result.stderr.splitlines()[0]
    assert BAD_FILES[case][2] in result.stderr


def test_item16_ordinary_aliases_still_work(env: Env) -> None:
    """Anchors for shared settings (the reason to allow aliases at all) load as before."""
    env.inventory.write_text(
        env.inventory.read_text().replace(
            "    pass_env: [WORKLOAD_SECRET]\n",
            "    pass_env: &secrets [WORKLOAD_SECRET]\n"
            "  work2:\n"
            '    argv: ["{python}", "{release}/workload.py", --output-dir, "{run_dir}"]\n'
            "    files: [workload.py]\n    packages: []\n    pass_env: *secrets\n",
        )
    )
    result = limited_cli(
        "--inventory", str(env.inventory), "deploy", "local", "--profile", "work2", "--dry-run", cwd=env.root
    )
    assert result.returncode == 0, result.stderr
    assert "workload.py" in result.stdout
    assert load_inventory(env.inventory).profile("work2").pass_env == ("WORKLOAD_SECRET",)
