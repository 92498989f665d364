"""A pct target's `provision:` block (issue 48): parsed and typed, every bad value refused with file:line:key,
and through the CLI one `error:` and one `hint:` line, exit 2, nothing run."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from dflashops.cli.main import main
from dflashops.core.errors import InventoryError
from dflashops.core.inventory import load_inventory

HEAD = """\
hosts:
  pve: {address: 192.0.2.10}
targets:
  ct300:
    kind: pct
    host: pve
    ctid: 300
    workspace: /workspace
    python: /workspace/venv/bin/python
    provision:
"""
GOOD = {
    "template": "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst",
    "storage": "local-lvm",
    "disk_gb": "64",
    "cores": "16",
    "memory_mb": "65536",
    "network": "name=eth0,bridge=vmbr0,ip=dhcp",
}


def write(tmp_path: Path, **fields: str | None) -> Path:
    merged = {**GOOD, **fields}
    body = "".join(f"      {key}: {value}\n" for key, value in merged.items() if value is not None)
    path = tmp_path / "inventory.yaml"
    path.write_text(HEAD + body)
    return path


def test_a_full_block_parses(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        gpus="[1, 0]",
        unprivileged="false",
        hostname="trainbox",
        driver_installer="/var/lib/vz/nvidia/NVIDIA-Linux-x86_64-{version}.run",
        packages="[torch==2.5.1, transformers==4.46.3, 'accelerate[torch]==1.1.0']",
        pip_args="[--no-index, --find-links, /workspace/wheels]",
    )
    spec = load_inventory(path).target("ct300").provision
    assert spec is not None
    assert (spec.storage, spec.disk_gb, spec.cores, spec.memory_mb, spec.swap_mb) == ("local-lvm", 64, 16, 65536, 0)
    assert spec.gpus == (0, 1) and spec.unprivileged is False and spec.hostname == "trainbox"
    assert spec.venv == "/workspace/venv" and spec.packages[2] == "accelerate[torch]==1.1.0"
    assert spec.pip_args == ("--no-index", "--find-links", "/workspace/wheels")
    assert spec.template and spec.clone is None


def test_defaults_and_all_gpus(tmp_path: Path) -> None:
    spec = load_inventory(write(tmp_path, gpus="all")).target("ct300").provision
    assert spec is not None
    assert spec.gpus is None and spec.unprivileged is True and spec.hostname == "ct300" and spec.venv is None
    spec = load_inventory(write(tmp_path)).target("ct300").provision
    assert spec is not None and spec.gpus == ()
    spec = load_inventory(write(tmp_path, template=None, clone="9000")).target("ct300").provision
    assert spec is not None and spec.clone == 9000 and spec.template is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"colour": "red"}, "targets.ct300.provision.colour: unknown key"),
        ({"clone": "9000"}, "exactly one of 'template'"),
        ({"template": None}, "exactly one of 'template'"),
        ({"template": "debian-12.tar.zst"}, "provision.template: expected a template volume"),
        ({"storage": None}, "missing required key 'storage'"),
        ({"disk_gb": "0"}, "provision.disk_gb: must be at least 1"),
        ({"cores": "many"}, "provision.cores: expected int"),
        ({"memory_mb": "8"}, "provision.memory_mb: must be at least 16"),
        ({"network": "bridge=vmbr0"}, "needs name= and bridge="),
        ({"network": "name=eth0,bridge=vmbr0,colour=red"}, "provision.network: colour="),
        ({"network": "'name=eth0,bridge=vmbr0;reboot'"}, "provision.network"),
        ({"gpus": "some"}, "provision.gpus: expected `all` or a list"),
        ({"gpus": "[0, 0]"}, "provision.gpus: GPU indices are distinct"),
        ({"gpus": "[-1]"}, "provision.gpus: GPU indices are distinct"),
        ({"unprivileged": "maybe"}, "provision.unprivileged: expected bool"),
        ({"hostname": "bad_name"}, "provision.hostname: 'bad_name' is not a host name"),
        ({"packages": "[torch]"}, "'torch' is not pinned: write NAME==VERSION"),
        ({"packages": "[torch>=2]"}, "'torch>=2' is not pinned"),
        ({"pip_args": "['--index-url=http://x y']"}, "provision.pip_args"),
        ({"driver_installer": "NVIDIA.run"}, "provision.driver_installer: expected an absolute path"),
        ({"clone": "7", "template": None}, "provision.clone: Proxmox vmids start at 100"),
    ],
)
def test_bad_values_name_file_line_and_key(tmp_path: Path, fields: dict[str, str | None], words: str) -> None:
    path = write(tmp_path, **fields)
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    assert words in caught.value.message and caught.value.message.startswith(f"{path}:")


def test_packages_need_a_venv_python_and_only_pct_targets_provision(tmp_path: Path) -> None:
    path = write(tmp_path, packages="[torch==2.5.1]")
    path.write_text(path.read_text().replace("/workspace/venv/bin/python", "python3"))
    with pytest.raises(InventoryError, match="must be a venv's bin/python"):
        load_inventory(path)
    path.write_text("targets:\n  here:\n    kind: local\n    workspace: ws\n    provision: {}\n")
    with pytest.raises(InventoryError, match="only a pct target's container is provisioned"):
        load_inventory(path)


def test_the_cli_says_one_error_and_one_hint(tmp_path: Path) -> None:
    path = write(tmp_path, gpus="some")
    before = path.read_text()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--inventory", str(path), "provision", "ct300", "--dry-run"])
    lines = err.getvalue().splitlines()
    assert code == 2 and out.getvalue() == ""
    assert [line.split(":")[0] for line in lines] == ["error", "hint"]
    assert "provision.gpus" in lines[0] and path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.yaml"]  # no lineage database, nothing else


def test_a_target_without_a_block_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path)
    path.write_text(path.read_text().split("    provision:")[0])
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["--inventory", str(path), "provision", "ct300", "--dry-run"])
    assert code == 2 and "error: target 'ct300' has no provision: block" in err.getvalue()
    assert "hint: declare the container" in err.getvalue()
