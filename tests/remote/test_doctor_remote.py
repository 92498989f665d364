"""`dflashops doctor` through sshd -> sudo pct -> container, with the container made to miss one thing at a time.

The faults are real inside the stand-in container's own mount namespace (container 210, used only here):
tmux hidden by a bind mount of a non-executable file, a full tmpfs over the workspace, a python without
torch (the host's /usr/bin/python3, which has neither torch nor transformers), a stopped and a missing
container, an untrusted host key. This machine has no GPU, so a target that declares `gpus:` really lacks
/dev/nvidia*; the one stand-in for hardware that cannot exist here is a fake `nvidia-smi` script on the
container's PATH (a tmpfs over /usr/local/bin inside the container only) that answers like a container
whose NVIDIA libraries do not match the host's kernel module.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from remote_harness import Harness

CTID = "210"
VENV_PYTHON = sys.executable  # has torch (CPU), transformers and triton; the container sees the same file


@pytest.fixture(scope="module")
def container(harness: Harness) -> str:
    harness.create_container(CTID, "doctor210")
    return CTID


@pytest.fixture
def doctor_inventory(tmp_path: Path, harness: Harness, container: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    workspace = f"/workspace/{tmp_path.name}"
    path = write_inventory(
        tmp_path / "inventory.yaml",
        harness,
        workspace=workspace,
        extra_targets=f"""\
        cpu: {{kind: pct, host: pve, ctid: {container}, workspace: {workspace}, python: {VENV_PYTHON}}}
        gpu: {{kind: pct, host: pve, ctid: {container}, workspace: {workspace}, python: {VENV_PYTHON}, gpus: [0, 1]}}
        notorch: {{kind: pct, host: pve, ctid: {container}, workspace: {workspace}, python: /usr/bin/python3}}
        nopython: {{kind: pct, host: pve, ctid: {container}, workspace: {workspace}, python: /opt/none/bin/python}}
        """,
    )
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    return path


def statuses(target: str, *extra: str) -> tuple[int, dict[str, str], str]:
    code, out, err = cli("doctor", target, "--json", *extra)
    report = json.loads(out)["targets"][0]
    return code, {c["name"]: c["status"] for c in report["checks"]}, err


def failing(found: dict[str, str]) -> set[str]:
    return {name for name, status in found.items() if status == "fail"}


def test_a_cpu_target_passes_and_skips_the_gpu_checks(doctor_inventory: Path) -> None:
    code, out, err = cli("doctor", "cpu")
    assert code == 0, out + err
    lines = out.splitlines()
    assert not any("FAIL" in line for line in lines), out
    for name in ("host", "container", "python", "torch", "tmux", "disk workspace", "workspace", "clock"):
        assert any(line.split()[1] == "ok" and f" {name} " in line for line in lines), (name, out)
    assert any(line.split()[1] == "skip" and "gpu devices" in line for line in lines)
    assert "cpu: 0 failed" in err


def test_a_target_that_declares_gpus_without_any_fails_exactly_the_gpu_checks(doctor_inventory: Path) -> None:
    code, found, err = statuses("gpu")
    assert code == 1 and "error: doctor: 3 check(s) failed on gpu" in err and "hint: " in err
    assert failing(found) == {"gpu devices", "nvidia-smi", "cuda"}
    assert found["driver"] == "skip" and found["torch"] == "ok"


def test_no_tmux_gives_the_one_tmux_line(doctor_inventory: Path, harness: Harness, container: str) -> None:
    harness.in_container(container, "sh", "-c", "touch /tmp/no-tmux && mount --bind /tmp/no-tmux /usr/bin/tmux")
    try:
        code, out, err = cli("doctor", "cpu")
    finally:
        harness.in_container(container, "umount", "/usr/bin/tmux")
    fails = [line for line in out.splitlines() if " FAIL " in line]
    assert code == 1 and len(fails) == 1 and " tmux " in fails[0], out
    assert "hint: apt-get install tmux in the target, or deploy with --launcher nohup" in out


def test_a_full_disk_gives_the_one_disk_line(doctor_inventory: Path, harness: Harness, container: str) -> None:
    workspace = f"/workspace/{doctor_inventory.parent.name}"
    harness.in_container(
        container,
        "sh",
        "-c",
        f"mkdir -p {workspace} && mount -t tmpfs -o size=4m tmpfs {workspace}"
        f" && (dd if=/dev/zero of={workspace}/fill bs=64k 2>/dev/null; true)",
    )
    try:
        code, found, _ = statuses("cpu")
    finally:
        harness.in_container(container, "umount", workspace)
    assert code == 1 and failing(found) == {"disk workspace"}, found
    assert found["workspace"] == "ok" and found["disk cache"] == "skip"  # same filesystem: one line, not two


def test_python_without_torch(doctor_inventory: Path) -> None:
    code, out, _ = cli("doctor", "notorch")
    found = {line.split()[2]: line.split()[1] for line in out.splitlines() if not line.lstrip().startswith("hint:")}
    assert code == 1 and {n for n, s in found.items() if s == "FAIL"} == {"torch", "transformers"}, out
    assert "cannot import torch: ModuleNotFoundError" in out and "hint: install torch into that python" in out


def test_a_missing_python_is_named_and_the_rest_still_runs(doctor_inventory: Path) -> None:
    code, found, _ = statuses("nopython")
    assert code == 1 and found["python"] == "fail" and found["torch"] == "skip"
    assert found["tmux"] == "ok" and found["disk workspace"] == "ok"


def test_nvml_mismatch_from_a_fake_nvidia_smi(doctor_inventory: Path, harness: Harness, container: str) -> None:
    fake = textwrap.dedent("""\
        #!/bin/sh
        echo "Failed to initialize NVML: Driver/library version mismatch"
        echo "NVML library version: 550.90"
        exit 18
        """)
    harness.in_container(
        container,
        "sh",
        "-c",
        "mount -t tmpfs tmpfs /usr/local/bin && "
        f"printf '%s' '{fake}' > /usr/local/bin/nvidia-smi && chmod +x /usr/local/bin/nvidia-smi",
    )
    try:
        code, out, _ = cli("doctor", "gpu")
    finally:
        harness.in_container(container, "umount", "/usr/local/bin")
    line = next(line for line in out.splitlines() if " nvidia-smi " in line)
    assert code == 1 and " FAIL " in line and "Driver/library version mismatch" in line
    assert "the container's NVIDIA libraries must be the host driver's exact version" in out


def test_stopped_missing_and_untrusted(doctor_inventory: Path, harness: Harness, tmp_path: Path) -> None:
    code, found, _ = statuses("ct201")
    assert code == 1 and found == {"host": "ok", "container": "fail", "target": "skip"}
    code, out, _ = cli("doctor", "ct999")
    assert code == 1 and "does not exist" in out and "hint: check the CTID" in out
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    text = doctor_inventory.read_text().replace(str(harness.known_hosts), str(empty))
    (tmp_path / "untrusted.yaml").write_text(text)
    code, out, _ = cli("--inventory", str(tmp_path / "untrusted.yaml"), "doctor", "ct200")
    assert (
        code == 1
        and " FAIL " in out
        and "hint: check the fingerprint out of band, then run: dflashops trust pve" in out
    )


def test_doctor_all_reports_every_target(doctor_inventory: Path) -> None:
    code, out, err = cli("doctor", "--all", "--json")
    reports = {r["target"]: r for r in json.loads(out)["targets"]}
    assert code == 1 and set(reports) >= {"ct200", "ct201", "ct999", "cpu", "gpu"}
    assert not reports["cpu"]["failed"], reports["cpu"]
    assert reports["ct201"]["failed"] and reports["gpu"]["failed"]


@pytest.fixture(autouse=True)
def _no_leftover_mounts(harness: Harness, container: str) -> Iterator[None]:
    yield
    mounts = harness.in_container(container, "cat", "/proc/self/mounts").stdout
    assert "/usr/bin/tmux" not in mounts and "/usr/local/bin" not in mounts
