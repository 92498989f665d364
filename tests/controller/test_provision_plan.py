"""The provision planner (issue 48) as the pure function it is: desired state + host/container facts -> steps.

Each refusal happens while planning, before any step exists; the GPU entries follow the host's device nodes and
/proc/devices, never assumed numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dflashops.core.errors import Conflict, NotFound
from dflashops.core.inventory import Host, Target
from dflashops.core.inventory_provision import ProvisionSpec
from dflashops.ops.provision.config import parse_config
from dflashops.ops.provision.facts import parse_char_majors, parse_driver_version, parse_nodes
from dflashops.ops.provision.plan import ContainerFacts, DeviceNode, HostFacts, plan_host
from dflashops.ops.provision.plan_container import finish_step, plan_container

TEMPLATE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
SPEC = ProvisionSpec(
    hostname="ct300",
    storage="local-lvm",
    disk_gb=32,
    cores=8,
    memory_mb=16384,
    network="name=eth0,bridge=vmbr0,ip=dhcp",
    template=TEMPLATE,
    gpus=(1,),
    driver_installer="/root/NVIDIA-Linux-x86_64-{version}.run",
)
TARGET = Target(name="ct300", kind="pct", workspace="/workspace", host=Host(name="pve", address="x"), ctid=300)
NODES = (
    DeviceNode("/dev/nvidia0", 195, 0),
    DeviceNode("/dev/nvidia1", 195, 1),
    DeviceNode("/dev/nvidiactl", 195, 255),
    DeviceNode("/dev/nvidia-uvm", 508, 0),
    DeviceNode("/dev/nvidia-uvm-tools", 508, 1),
    DeviceNode("/dev/nvidia-caps/nvidia-cap2", 237, 2),
    DeviceNode("/dev/nvidia-caps/nvidia-cap1", 237, 1),
)
FACTS = HostFacts(
    host="pve",
    driver_version="550.54.14",
    device_nodes=NODES,
    char_majors={"nvidia-frontend": 195, "nvidia-uvm": 508, "nvidia-caps": 237},
    pct_has_dev=True,
    containers={},
    templates=frozenset({TEMPLATE}),
    storage_free_gb=100.0,
    installer_present=True,
)


def commands(steps: list) -> list[list[str]]:
    return [list(step.argv) for step in steps]


def test_a_new_container_is_created_configured_with_its_gpu_and_started() -> None:
    plan = plan_host(TARGET, SPEC, FACTS)
    create, configure, start = commands(plan.steps)
    assert create[:4] == ["pct", "create", "300", TEMPLATE]
    assert create[create.index("--rootfs") + 1] == "local-lvm:32" and "--unprivileged" in create
    assert create[create.index("--tags") + 1] == "dflashops-unfinished"
    assert configure[:3] == ["pct", "set", "300"]
    devs = dict(zip(configure[3::2], configure[4::2]))
    assert devs == {
        "--dev0": "/dev/nvidia1,mode=0666",  # GPU 1 only: /dev/nvidia0 is not asked for
        "--dev1": "/dev/nvidiactl,mode=0666",
        "--dev2": "/dev/nvidia-uvm,mode=0666",
        "--dev3": "/dev/nvidia-uvm-tools,mode=0666",
        "--dev4": "/dev/nvidia-caps/nvidia-cap1,mode=0666",
        "--dev5": "/dev/nvidia-caps/nvidia-cap2,mode=0666",
    }
    assert start == ["pct", "start", "300"]
    assert plan.before == [] and "dev0: /dev/nvidia1,mode=0666" in plan.after


def test_older_pct_gets_lxc_lines_with_majors_from_proc_devices() -> None:
    facts = replace(FACTS, pct_has_dev=False, char_majors={"nvidia-uvm": 511, "nvidia-caps": 240})
    plan = plan_host(TARGET, SPEC, facts)
    manual = [step for step in plan.steps if step.where == "manual"]
    assert len(manual) == 1 and not any(a.startswith("--dev") for step in plan.steps for a in step.argv)
    lines = manual[0].lines
    # /proc/devices' majors (511, 240), not the nodes' (508, 237): the module's numbers of this boot
    assert [line for line in lines if "devices.allow" in line] == [
        "lxc.cgroup2.devices.allow: c 195:* rwm",
        "lxc.cgroup2.devices.allow: c 240:* rwm",
        "lxc.cgroup2.devices.allow: c 511:* rwm",
    ]
    assert "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file" in lines
    assert "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file" in lines
    assert not any("/dev/nvidia0 " in line for line in lines)
    # once the lines are in the config, the plan has nothing left to add
    done = parse_config("\n".join(plan.after))
    again = plan_host(TARGET, SPEC, replace(facts, containers={300: done}, running=frozenset({300})))
    assert again.steps == []


def test_a_container_as_declared_plans_nothing() -> None:
    plan = plan_host(TARGET, SPEC, FACTS)
    config = parse_config("\n".join(plan.after).replace("dflashops-unfinished", "dflashops"))
    facts = replace(FACTS, containers={300: config}, running=frozenset({300}))
    again = plan_host(TARGET, SPEC, facts)
    assert again.steps == [] and again.notes == [] and again.before == again.after
    assert finish_step(300, config) is None


def test_refusals_change_nothing_and_name_the_fix() -> None:
    theirs = parse_config("hostname: web\nunprivileged: 1\ntags: prod\n")
    with pytest.raises(Conflict, match="vmid 300 on pve is taken by container 'web'") as taken:
        plan_host(TARGET, SPEC, replace(FACTS, containers={300: theirs}))
    assert "--adopt" in (taken.value.hint or "")
    adopted = plan_host(TARGET, SPEC, replace(FACTS, containers={300: theirs}), adopt=True)
    assert adopted.notes == ["adopting container 300 (tagging it dflashops)"]
    assert adopted.steps[0].argv[adopted.steps[0].argv.index("--tags") + 1] == "prod;dflashops-unfinished"
    with pytest.raises(NotFound, match="template .* is not on pve's storage 'local'") as missing:
        plan_host(TARGET, SPEC, replace(FACTS, templates=frozenset()))
    assert missing.value.hint == (
        "fetch it on the host: pveam update && pveam download local debian-12-standard_12.7-1_amd64.tar.zst"
    )
    with pytest.raises(Conflict, match="has 3.0 GiB free, the container's disk needs 32 GiB"):
        plan_host(TARGET, SPEC, replace(FACTS, storage_free_gb=3.0))
    busy = parse_config("hostname: other\ndev0: /dev/nvidia1,mode=0666\n")
    with pytest.raises(Conflict, match=r"GPU 1 \(/dev/nvidia1\) is passed to container 205 \(other\)"):
        plan_host(TARGET, SPEC, replace(FACTS, containers={205: busy}))
    legacy = parse_config("hostname: old\nlxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file\n")
    with pytest.raises(Conflict, match="is passed to container 206"):
        plan_host(TARGET, SPEC, replace(FACTS, containers={206: legacy}))
    with pytest.raises(NotFound, match="pve has no /dev/nvidia7"):
        plan_host(TARGET, replace(SPEC, gpus=(7,)), FACTS)
    with pytest.raises(NotFound, match="clone source 9000 does not exist"):
        plan_host(TARGET, replace(SPEC, template=None, clone=9000), FACTS)


def test_a_running_container_is_not_changed_under_its_runs() -> None:
    ours = parse_config("hostname: ct300\nunprivileged: 1\ntags: dflashops\ncores: 2\n")
    with pytest.raises(Conflict, match="container 300 is running and its config needs changes") as running:
        plan_host(TARGET, SPEC, replace(FACTS, containers={300: ours}, running=frozenset({300})))
    assert "pct shutdown 300" in (running.value.hint or "")
    stopped = plan_host(TARGET, SPEC, replace(FACTS, containers={300: ours}))
    set_step = stopped.steps[0].argv
    assert set_step[set_step.index("--cores") + 1] == "8" and "--dev0" in set_step
    assert set_step[set_step.index("--tags") + 1] == "dflashops-unfinished"
    assert stopped.steps[-1].argv == ("pct", "start", "300")


def test_gpu_changes_keep_matching_entries_and_delete_the_rest() -> None:
    config = parse_config(
        "hostname: ct300\nunprivileged: 1\ntags: dflashops\ncores: 8\nmemory: 16384\nswap: 0\n"
        "net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=dhcp,type=veth\n"
        "rootfs: local-lvm:vm-300-disk-0,size=16G\n"
        "dev0: /dev/nvidia0,mode=0666\ndev1: /dev/nvidiactl,mode=0666\ndev7: /dev/fuse\n"
    )
    plan = plan_host(TARGET, SPEC, replace(FACTS, containers={300: config}))
    argv = plan.steps[0].argv
    assert argv[argv.index("--delete") + 1] == "dev0"  # /dev/nvidia0 goes; /dev/fuse (not ours) stays
    assert "--dev1" not in argv and "--net0" not in argv  # already right; the generated hwaddr is no change
    assert plan.steps[1].argv == ("pct", "resize", "300", "rootfs", "32G")
    assert "dev7: /dev/fuse" in plan.after and "dev0: /dev/nvidia0,mode=0666" not in plan.after


def test_unprivileged_cannot_change_and_clone_keeps_the_source_but_a_new_mac() -> None:
    privileged = parse_config("hostname: ct300\nunprivileged: 0\ntags: dflashops\n")
    with pytest.raises(Conflict, match="container 300 is privileged"):
        plan_host(TARGET, SPEC, replace(FACTS, containers={300: privileged}))
    source = parse_config(
        "hostname: base\nunprivileged: 1\ntemplate: 1\ncores: 8\nmemory: 16384\nswap: 0\n"
        "net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:AA:AA:AA,ip=dhcp,type=veth\n"
        "rootfs: local-lvm:base-9000-disk-0,size=32G\n"
    )
    plan = plan_host(TARGET, replace(SPEC, template=None, clone=9000), replace(FACTS, containers={9000: source}))
    clone = list(plan.steps[0].argv)
    assert clone[:4] == ["pct", "clone", "9000", "300"] and clone[clone.index("--hostname") + 1] == "ct300"
    assert not any("hwaddr=BC:24:11:AA:AA:AA" in line for line in plan.after)
    assert not any(line.startswith("template:") for line in plan.after)


def test_container_steps_install_the_host_driver_version_without_a_kernel_module() -> None:
    spec = replace(SPEC, venv="/workspace/venv", packages=("tinypkg==1.0",), pip_args=("--no-index",))
    steps = plan_container(TARGET, spec, FACTS, ContainerFacts(nvidia_version="535.0", python3=True))
    argvs = commands(steps)
    assert argvs[0] == ["pct", "push", "300", "/root/NVIDIA-Linux-x86_64-550.54.14.run", steps[1].argv[1]]
    assert argvs[1][2:] == ["--silent", "--no-kernel-module"] and "(has 535.0)" in steps[1].title
    assert argvs[3] == ["nvidia-smi", "-L"] and steps[3].check
    assert argvs[4] == ["python3", "-m", "venv", "/workspace/venv"]
    assert argvs[5][-2:] == ["--no-index", "tinypkg==1.0"]
    done = ContainerFacts(
        nvidia_version="550.54.14", gpu_count=1, venv_python=True, installed=frozenset({"tinypkg==1.0"})
    )
    assert [step.check for step in plan_container(TARGET, spec, FACTS, done)] == [True]
    with pytest.raises(NotFound, match="the driver installer /root/NVIDIA-Linux-x86_64-550.54.14.run is not on pve"):
        plan_container(TARGET, spec, replace(FACTS, installer_present=False), ContainerFacts())
    with pytest.raises(NotFound, match="pve has no NVIDIA driver loaded"):
        plan_container(TARGET, spec, replace(FACTS, driver_version=None), ContainerFacts())


def test_the_host_files_are_read_as_the_kernel_writes_them() -> None:
    assert (
        parse_driver_version(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
        )
        == "550.54.14"
    )
    assert parse_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build")
    assert parse_driver_version("") is None
    majors = parse_char_majors(
        "Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n237 nvidia-caps\n\nBlock devices:\n"
        "  8 sd\n508 nvidia-uvm-not-a-char\n"
    )
    assert majors == {"mem": 1, "nvidia-frontend": 195, "nvidia-uvm": 508, "nvidia-caps": 237}
    assert parse_nodes("/dev/nvidia0 c3 0\n/dev/nvidia-uvm 1fc 1\n/dev/null 1 3\n") == (
        DeviceNode("/dev/nvidia0", 195, 0),
        DeviceNode("/dev/nvidia-uvm", 508, 1),
    )
