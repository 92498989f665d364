"""`dflashops provision` through a real sshd -> sudo pct stand-in, on a fake GPU host (provision_host.py).

Planned first (--dry-run changes nothing), applied with a progress line per step, idempotent (a second run
changes nothing and says so), refusals with one error and one hint before anything changes, the NVIDIA
userspace of the host's driver version installed without a kernel module, and a half-made container finished by
the next run.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli
from provision_host import DRIVER, TEMPLATE, GpuHost, add_installer, host_pct, set_host_driver, start_gpu_host
from remote_harness import PROVISION_USER, Harness


@pytest.fixture(scope="module")
def gpu_host(harness: Harness) -> Iterator[GpuHost]:
    host = start_gpu_host(harness)
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture
def made(harness: Harness) -> Iterator[list[int]]:
    """The vmids a test makes: stopped and destroyed after it, so the next test's GPUs are free."""
    vmids: list[int] = []
    yield vmids
    for vmid in vmids:
        harness.pct("stop", str(vmid), check=False)
        harness.pct("destroy", str(vmid), check=False)


def write_inventory(
    path: Path,
    h: Harness,
    host: GpuHost,
    ctid: int,
    extra: str = "",
    python: str = "/workspace/box/venv/bin/python",
    **fields: str,
) -> Path:
    block = {
        "template": TEMPLATE,
        "storage": "local-lvm",
        "disk_gb": "8",
        "cores": "4",
        "memory_mb": "4096",
        "network": "name=eth0,bridge=vmbr0,ip=dhcp",
        "gpus": "[1]",
        "driver_installer": f"{host.folder}/installers/NVIDIA-Linux-x86_64-{{version}}.run",
        **fields,
    }
    lines = "".join(f"      {key}: {value}\n" for key, value in block.items() if value)
    path.write_text(
        textwrap.dedent(f"""\
        hosts:
          gpuhost:
            address: 127.0.0.1
            port: {host.port}
            user: {PROVISION_USER}
            identity_file: {h.client_key}
            known_hosts: {h.known_hosts}
            sudo: true
        targets:
          box:
            kind: pct
            host: gpuhost
            ctid: {ctid}
            workspace: /workspace/box
            python: {python}
            provision:
        """)
        + lines
        + extra
    )
    h.trust_port(host.port)
    return path


def config_of(h: Harness, ctid: int) -> str:
    return h.pct("config", str(ctid)).stdout


def test_plan_apply_and_a_second_run_that_changes_nothing(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    ctid = 300
    made.append(ctid)
    wheels = harness.pct_state / str(ctid) / "workspace" / "wheels"  # the container's /workspace/wheels
    wheels.mkdir(parents=True)
    make_wheel(wheels)
    inventory = write_inventory(
        tmp_path / "inventory.yaml",
        harness,
        gpu_host,
        ctid,
        packages="[tinypkg==1.0]",
        pip_args="[--no-index, --find-links, /workspace/wheels]",
    )
    code, out, err = cli("--inventory", str(inventory), "provision", "box", "--dry-run")
    assert code == 0, err
    assert not (harness.pct_state / str(ctid) / f"{ctid}.conf").exists()  # planned only
    lines = out.splitlines()
    assert lines[0].startswith(f"sudo -n pct create {ctid} {TEMPLATE} --hostname box --cores 4")
    assert f"sudo -n pct set {ctid} --dev0 /dev/nvidia1,mode=0666 --dev1 /dev/nvidiactl,mode=0666" in out
    assert "--dev4 /dev/nvidia-caps/nvidia-cap1,mode=0666 --dev5 /dev/nvidia-caps/nvidia-cap2,mode=0666" in out
    assert f"sudo -n pct exec {ctid} -- sh /tmp/dflashops-nvidia-installer.run --silent --no-kernel-module" in out
    assert "+dev0: /dev/nvidia1,mode=0666" in lines and "--- /dev/null" in lines
    assert f"sudo -n pct exec {ctid} -- nvidia-smi -L   # check" in lines

    code, out, err = cli("--inventory", str(inventory), "provision", "box")
    assert code == 0, err
    assert out.strip().startswith(f"container {ctid} (box) provisioned:")
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert progress[0] == f"[1/3] create container {ctid} from {TEMPLATE}"
    assert any("install the NVIDIA userspace 550.54.14, no kernel module" in line for line in progress)
    config = config_of(harness, ctid)
    assert "tags: dflashops\n" in config and "dev0: /dev/nvidia1,mode=0666" in config
    assert "dflashops-unfinished" not in config
    inside = harness.pct_state / str(ctid) / "usr-local-bin"
    assert (inside / ".nvidia-installer.log").read_text() == f"{DRIVER} --silent --no-kernel-module\n"
    listed = harness.in_container(str(ctid), "nvidia-smi", "-L").stdout.splitlines()
    assert listed == ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000-1)"]  # GPU 1 of the host, and only it
    frozen = harness.in_container(str(ctid), "/workspace/box/venv/bin/python", "-m", "pip", "freeze").stdout
    assert "tinypkg==1.0" in frozen

    code, out, err = cli("--inventory", str(inventory), "provision", "box")
    assert code == 0, err
    assert out.strip() == f"container {ctid} (box) is as declared: nothing changed"
    assert not [line for line in err.splitlines() if line.startswith("[") and "check" not in line]
    assert (inside / ".nvidia-installer.log").read_text().count("\n") == 1
    code, out, _ = cli("--inventory", str(inventory), "provision", "box", "--dry-run")
    assert code == 0 and out.splitlines()[-1] == f"# container {ctid} is as declared: nothing to change"


def make_wheel(folder: Path) -> None:
    """tinypkg 1.0 as a wheel pip installs offline (--no-index --find-links)."""
    import zipfile

    dist = "tinypkg-1.0.dist-info"
    files = {
        "tinypkg/__init__.py": "VALUE = 1\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / "tinypkg-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            wheel.writestr(name, text)


def refused(inventory: Path, *extra: str) -> tuple[int, str, str]:
    code, out, err = cli("--inventory", str(inventory), "provision", "box", *extra)
    lines = err.splitlines()
    assert code != 0 and [line.split(":")[0] for line in lines[-2:]] == ["error", "hint"], err
    assert not [line for line in lines if line.startswith("[")]  # no step ran
    return code, lines[-2], lines[-1]


def test_refusals_before_any_change(tmp_path: Path, harness: Harness, gpu_host: GpuHost) -> None:
    path = tmp_path / "inventory.yaml"
    before = sorted(p.name for p in harness.pct_state.iterdir())
    inventory = write_inventory(path, harness, gpu_host, 310, template="local:vztmpl/debian-13-missing.tar.zst")
    _, error, hint = refused(inventory)
    assert "template local:vztmpl/debian-13-missing.tar.zst is not on gpuhost's storage 'local'" in error
    assert hint == "hint: fetch it on the host: pveam update && pveam download local debian-13-missing.tar.zst"
    inventory = write_inventory(path, harness, gpu_host, 200)  # the harness's container, not ours
    code, error, hint = refused(inventory)
    assert code == 4 and "vmid 200 on gpuhost is taken by container 'gpu200'" in error and "--adopt" in hint
    (gpu_host.knobs / "storage" / "local-lvm").write_text(str(2 * 1024 * 1024))  # 2 GiB free, in KiB
    try:
        _, error, hint = refused(write_inventory(path, harness, gpu_host, 310))
        assert "storage 'local-lvm' on gpuhost has 2.0 GiB free, the container's disk needs 8 GiB" in error
    finally:
        (gpu_host.knobs / "storage" / "local-lvm").unlink()
    holder = harness.pct_state / "311"
    holder.mkdir()
    (holder / "311.conf").write_text("arch: amd64\nhostname: holder\ndev0: /dev/nvidia1\n")
    try:
        _, error, hint = refused(write_inventory(path, harness, gpu_host, 310))
        assert "GPU 1 (/dev/nvidia1) is passed to container 311 (holder) in its config" in error
        _, error, _ = refused(write_inventory(path, harness, gpu_host, 310, gpus="[5]"))
        assert "gpuhost has no /dev/nvidia5 (its GPUs: 0, 1)" in error
    finally:
        (holder / "311.conf").unlink()
        holder.rmdir()
    assert sorted(p.name for p in harness.pct_state.iterdir()) == before


def test_a_half_made_container_is_finished_by_the_next_run(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    """The installer is missing when the run reaches the container's steps: the container exists, tagged
    unfinished, and the error says so; with the installer in place the next run finishes it."""
    ctid = 320
    made.append(ctid)
    missing = f"{gpu_host.folder}/none/NVIDIA-Linux-x86_64-{{version}}.run"
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid, driver_installer=missing)
    code, out, err = cli("--inventory", str(inventory), "provision", "box")
    lines = err.splitlines()
    assert code == 3 and lines[-2].startswith("error: the driver installer") and lines[-1].startswith("hint: ")
    assert f"provision again to finish container {ctid} (tagged dflashops-unfinished)" in lines[-1]
    assert "tags: dflashops-unfinished" in config_of(harness, ctid)
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid)
    code, out, err = cli("--inventory", str(inventory), "provision", "box")
    assert code == 0, err
    assert f"container {ctid} was left unfinished by an earlier run: finishing it" in err
    assert "tags: dflashops\n" in config_of(harness, ctid)
    assert harness.in_container(str(ctid), "nvidia-smi", "-L").stdout.count("GPU ") == 1


def test_adopt_tags_a_container_it_did_not_make(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    ctid = 330
    made.append(ctid)
    folder = harness.pct_state / str(ctid)
    folder.mkdir()
    (folder / f"{ctid}.conf").write_text(
        "arch: amd64\ncores: 4\nhostname: box\nmemory: 4096\nnet0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:01:02:03,"
        "ip=dhcp,type=veth\nrootfs: local-lvm:vm-330-disk-0,size=8G\nswap: 0\ntags: mine\nunprivileged: 1\n"
    )
    (folder / "provisioned").touch()
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid, gpus="")
    code, error, hint = refused(inventory)
    assert code == 4 and "which dflashops did not create" in error
    code, out, err = cli("--inventory", str(inventory), "provision", "box", "--adopt")
    assert code == 0, err
    assert "adopting container 330 (tagging it dflashops)" in err
    assert "tags: mine;dflashops\n" in config_of(harness, ctid)
    code, out, _ = cli("--inventory", str(inventory), "provision", "box")
    assert code == 0 and "nothing changed" in out


def test_an_older_pct_gets_lxc_lines_to_add_by_hand(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    ctid = 340
    made.append(ctid)
    (gpu_host.knobs / "no-dev").touch()
    try:
        inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid)
        code, out, err = cli("--inventory", str(inventory), "provision", "box", "--dry-run")
        assert code == 0, err
        assert "--dev0" not in out
        assert "+lxc.cgroup2.devices.allow: c 508:* rwm" in out.splitlines()  # nvidia-uvm, from /proc/devices
        assert "+lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file" in out.splitlines()
        code, out, err = cli("--inventory", str(inventory), "provision", "box")
        lines = err.splitlines()
        assert code == 6 and "gpuhost's pct has no devN option: add 9 GPU lines" in lines[-2]
        plan = cli("--inventory", str(inventory), "provision", "box", "--dry-run")[1]
        added = [line[1:] for line in plan.splitlines() if line.startswith("+lxc.")]
        conf = harness.pct_state / str(ctid) / f"{ctid}.conf"
        conf.write_text(conf.read_text() + "".join(f"{line}\n" for line in added))  # by hand, as the hint says
        code, out, err = cli("--inventory", str(inventory), "provision", "box")
        assert code == 0, err
        assert harness.in_container(str(ctid), "nvidia-smi", "-L").stdout.count("GPU ") == 1
    finally:
        (gpu_host.knobs / "no-dev").unlink()


SLEEPER = """\
profiles:
  sleeper:
    argv: ["{python}", "-c", "import time; time.sleep(600)"]
    packages: []
"""


def test_repair_after_a_host_driver_upgrade_waits_for_the_run(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    ctid = 350
    made.append(ctid)
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid, SLEEPER, python="python3")
    assert cli("--inventory", str(inventory), "provision", "box")[0] == 0
    new = "555.42.06"
    add_installer(gpu_host, new)
    set_host_driver(gpu_host, new)
    try:
        host_pct(gpu_host, "stop", str(ctid))  # the module reload that comes with a driver upgrade restarts it
        host_pct(gpu_host, "start", str(ctid))
        code, error, hint = refused(inventory)
        assert code == 4
        assert (
            error
            == f"error: driver drift in container {ctid}: its NVIDIA userspace is {DRIVER}, the host's driver {new}"
        )
        assert "dflashops provision box --repair" in hint
        code, out, err = cli("--inventory", str(inventory), "deploy", "box", "--profile", "sleeper", "--name", "nap")
        assert code == 0, err
        code, error, hint = refused(inventory, "--repair")
        assert code == 4 and error.startswith(f"error: run nap is active in container {ctid}: not re-installing")
        assert "dflashops stop nap" in hint
        assert cli("--inventory", str(inventory), "stop", "nap")[0] == 0
        code, out, err = cli("--inventory", str(inventory), "provision", "box", "--repair")
        assert code == 0, err
        log = (harness.pct_state / str(ctid) / "usr-local-bin" / ".nvidia-installer.log").read_text()
        assert log.splitlines() == [f"{DRIVER} --silent --no-kernel-module", f"{new} --silent --no-kernel-module"]
        assert harness.in_container(str(ctid), "nvidia-smi", "-L").stdout.count("GPU ") == 1
    finally:
        set_host_driver(gpu_host, DRIVER)


def test_destroy_needs_the_name_typed_back(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    ctid = 360
    made.append(ctid)
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid, gpus="")
    assert cli("--inventory", str(inventory), "provision", "box")[0] == 0
    code, error, hint = refused(inventory, "--destroy")
    assert code == 2 and error == f"error: destroying container {ctid} needs its name typed back"
    assert hint == "hint: pass --yes-destroy box"
    code, error, _ = refused(inventory, "--destroy", "--yes-destroy", "box2")
    assert code == 2 and "('box2' is not 'box')" in error
    code, out, err = cli("--inventory", str(inventory), "provision", "box", "--destroy", "--dry-run")
    assert code == 0, err
    assert out.splitlines() == [
        f"sudo -n pct stop {ctid}",
        f"sudo -n pct destroy {ctid}",
        "# to run it: dflashops provision box --destroy --yes-destroy box",
    ]
    assert (harness.pct_state / str(ctid) / f"{ctid}.conf").exists()
    code, out, err = cli("--inventory", str(inventory), "provision", "box", "--destroy", "--yes-destroy", "box")
    assert code == 0, err
    assert out.strip() == f"container {ctid} (box) destroyed"
    assert not (harness.pct_state / str(ctid)).exists()
    theirs = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, 200)
    code, error, hint = refused(theirs, "--destroy", "--yes-destroy", "gpu200")
    assert code == 4 and "container 200 (gpu200) on gpuhost was not created by dflashops" in error
    assert "running" in harness.pct("status", "200").stdout


def test_two_provisions_at_once_act_once(tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]) -> None:
    """Two runs started together: one provisions, the other is refused naming it (or, when it comes after the
    first has finished, finds nothing to change); the installer runs once and the container ends as declared."""
    import subprocess
    import sys
    import time

    ctid = 370
    made.append(ctid)
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid)
    argv = [sys.executable, "-m", "dflashops", "--inventory", str(inventory), "provision", "box"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outcomes = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=300)
        outcomes.append((proc.returncode, out.strip(), err.strip().splitlines()[-2:]))
    finished = [o for o in outcomes if o[0] == 0 and "provisioned:" in o[1]]
    assert len(finished) == 1, outcomes
    other = next(o for o in outcomes if o is not finished[0])
    assert (other[0] == 0 and "nothing changed" in other[1]) or (
        other[0] == 4
        and other[2][0].startswith(f"error: container {ctid} on gpuhost is being provisioned by another run (")
        and other[2][1].startswith("hint: wait for it to end; if that run is gone for good, remove /run/lock/")
    ), outcomes
    log = (harness.pct_state / str(ctid) / "usr-local-bin" / ".nvidia-installer.log").read_text()
    assert log.count("\n") == 1 and "tags: dflashops\n" in config_of(harness, ctid)


def test_a_stale_lock_of_this_machine_is_taken_over_another_machines_is_named(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    import socket
    import subprocess

    from provision_host import in_host

    ctid = 380
    made.append(ctid)
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid, gpus="")
    ended = subprocess.Popen(["true"])
    ended.wait()  # a pid of this machine that has ended (the run that held the lock was killed)
    lock = f"/run/lock/dflashops-provision-{ctid}"
    in_host(
        gpu_host,
        f"mkdir {lock} && echo '{socket.gethostname()} pid {ended.pid} since 2026-12-06T01:00:00Z' > {lock}/owner && chown -R {PROVISION_USER} {lock}",
    )
    code, out, err = cli("--inventory", str(inventory), "provision", "box")
    assert code == 0, err
    assert f"the provision lock of {socket.gethostname()} pid {ended.pid}" in err and "taking it over" in err
    assert in_host(gpu_host, f"test -e {lock} && echo held || echo free").stdout.strip() == "free"
    in_host(gpu_host, f"mkdir {lock} && echo 'laptop2 pid 4242 since 2026-12-06T01:00:00Z' > {lock}/owner")
    try:
        code, error, hint = refused(inventory)
        assert code == 4 and "is being provisioned by another run (laptop2 pid 4242 since" in error
        assert hint == f"hint: wait for it to end; if that run is gone for good, remove {lock} on gpuhost"
        code, out, _ = cli("--inventory", str(inventory), "provision", "box", "--dry-run")
        assert code == 0 and "nothing to change" in out  # a plan is reading only: it needs no lock
    finally:
        in_host(gpu_host, f"rm -rf {lock}")


def test_clone_to_another_vmid(tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]) -> None:
    """Another container like the source's (same template and checks, its own hostname and MAC), and the inventory
    entry for it; the source's GPU is busy for a clone on the same host."""
    made += [390, 392, 393]
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, 390)
    assert cli("--inventory", str(inventory), "provision", "box")[0] == 0
    code, error, hint = refused(inventory, "--clone", "box", "--to", "gpuhost:391")  # a TARGET too (`box`)
    assert code == 2 and "--clone SOURCE and --to HOST:VMID go together, without a TARGET" in error
    code, out, err = cli("--inventory", str(inventory), "provision", "--clone", "box", "--to", "gpuhost:391")
    assert code == 4 and "error: GPU 1 (/dev/nvidia1) is passed to container 390 (box) in its config" in err
    code, out, err = cli("--inventory", str(inventory), "provision", "--clone", "box", "--to", "gpuhost:12")
    assert code == 2 and "error: --to 'gpuhost:12': expected HOST:VMID" in err
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, 392, gpus="")
    assert cli("--inventory", str(inventory), "provision", "box")[0] == 0
    code, out, err = cli("--inventory", str(inventory), "provision", "--clone", "box", "--to", "gpuhost:393")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("container 393 (box-393) provisioned:")
    assert lines[2] == "  box-393:" and "    ctid: 393" in lines and "      hostname: box-393" in lines, out
    source, clone = config_of(harness, 392), config_of(harness, 393)
    assert "hostname: box-393\n" in clone and "tags: dflashops\n" in clone
    mac = re.compile(r"hwaddr=([0-9A-F:]+)")
    assert mac.search(source) and mac.search(clone) and mac.search(source)[1] != mac.search(clone)[1]
    pasted = tmp_path / "inventory.yaml"  # targets: is its last section
    pasted.write_text(pasted.read_text() + "\n".join(lines[2:]) + "\n")
    code, out, err = cli("--inventory", str(pasted), "provision", "box-393")
    assert code == 0 and "nothing changed" in out, err  # the printed entry declares what was made


def test_a_run_killed_mid_install_is_finished_by_the_next(
    tmp_path: Path, harness: Harness, gpu_host: GpuHost, made: list[int]
) -> None:
    """SIGKILL while the installer runs: the container stays tagged unfinished and the lock names a process that
    has ended; the next run takes the lock over, installs again and finishes."""
    import os
    import signal
    import subprocess
    import sys

    ctid = 400
    made.append(ctid)
    workspace = harness.pct_state / str(ctid) / "workspace"
    workspace.mkdir(parents=True)
    (workspace / ".slow-installer").touch()
    inventory = write_inventory(tmp_path / "inventory.yaml", harness, gpu_host, ctid)
    argv = [sys.executable, "-m", "dflashops", "--inventory", str(inventory), "provision", "box"]
    run = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert run.stderr is not None
    seen = []
    for line in run.stderr:
        seen.append(line)
        if "install the NVIDIA userspace" in line:
            break
    os.kill(run.pid, signal.SIGKILL)  # our own child, by its pid
    run.wait()
    assert any("install the NVIDIA userspace" in line for line in seen), seen
    assert "dflashops-unfinished" in config_of(harness, ctid)
    (workspace / ".slow-installer").unlink()
    code, out, err = cli("--inventory", str(inventory), "provision", "box")
    assert code == 0, err
    assert f"pid {run.pid} since" in err and "is stale (that process has ended): taking it over" in err
    assert f"container {ctid} was left unfinished by an earlier run: finishing it" in err
    assert "tags: dflashops\n" in config_of(harness, ctid)
    assert harness.in_container(str(ctid), "nvidia-smi", "-L").stdout.count("GPU ") == 1
