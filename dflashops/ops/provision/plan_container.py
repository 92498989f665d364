"""The planner's second phase: steps inside the running container, then the tag that marks it finished.

The NVIDIA userspace of the host driver's exact version, installed without a kernel module (the host's module
serves every container), the `nvidia-smi` check, python's venv and the pinned packages that are missing. Pure, as
plan.py: facts in, steps out.
"""

from __future__ import annotations

from dflashops.core.errors import NotFound
from dflashops.core.inventory import Target
from dflashops.core.inventory_provision import ProvisionSpec
from dflashops.ops.provision import config as cfg
from dflashops.ops.provision.config import OWNER_TAG, UNFINISHED_TAG, Lines
from dflashops.ops.provision.plan import ContainerFacts, HostFacts, Step

INSTALLER_IN_CT = "/tmp/dflashops-nvidia-installer.run"
INSTALLER_FLAGS = ("--silent", "--no-kernel-module")  # the host's kernel module serves the container


def _normalise(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    return f"{name.split('[')[0].lower().replace('_', '-')}=={version}"


def plan_container(target: Target, spec: ProvisionSpec, facts: HostFacts, ct: ContainerFacts) -> list[Step]:
    """Steps inside the (running) container, then the tag that marks it finished."""
    vmid = str(target.ctid)
    steps: list[Step] = []
    gpus = len(spec.gpus) if spec.gpus is not None else len(facts.gpu_nodes())
    if gpus:
        version = facts.driver_version
        if version is None:
            raise NotFound(
                f"{facts.host} has no NVIDIA driver loaded (/proc/driver/nvidia/version is missing)",
                hint="install the driver on the host first (its kernel module serves every container)",
            )
        if ct.nvidia_version != version:
            if spec.driver_installer is None:
                raise NotFound(
                    f"container {vmid} needs the NVIDIA userspace {version} and provision.driver_installer is not set",
                    hint=f"download NVIDIA-Linux-x86_64-{version}.run to the host and name it in provision.driver_installer",
                )
            source = spec.driver_installer.replace("{version}", version)
            if not facts.installer_present:
                raise NotFound(
                    f"the driver installer {source} is not on {facts.host}",
                    hint=f"download it there: https://download.nvidia.com/XFree86/Linux-x86_64/{version}/NVIDIA-Linux-x86_64-{version}.run",
                )
            was = f" (has {ct.nvidia_version})" if ct.nvidia_version else ""
            steps.append(
                Step(
                    f"copy the NVIDIA {version} installer into container {vmid}",
                    "host",
                    ("pct", "push", vmid, source, INSTALLER_IN_CT),
                )
            )
            steps.append(
                Step(
                    f"install the NVIDIA userspace {version}, no kernel module{was}",
                    "container",
                    ("sh", INSTALLER_IN_CT, *INSTALLER_FLAGS),
                )
            )
            steps.append(Step("remove the installer", "container", ("rm", "-f", INSTALLER_IN_CT)))
        steps.append(
            Step(
                f"check: nvidia-smi lists {gpus} GPU{'s' * (gpus != 1)} of driver {version}",
                "container",
                ("nvidia-smi", "-L"),
                check=True,
            )
        )
    if spec.venv is not None:
        if not ct.python3:
            steps.append(
                Step(
                    "install python3 and venv",
                    "container",
                    ("apt-get", "install", "-y", "-q", "python3", "python3-venv"),
                )
            )
        if not ct.venv_python:
            steps.append(Step(f"create the venv {spec.venv}", "container", ("python3", "-m", "venv", spec.venv)))
        missing = [p for p in spec.packages if _normalise(p) not in ct.installed]
        if missing:
            steps.append(
                Step(
                    f"install {', '.join(missing)}",
                    "container",
                    (
                        f"{spec.venv}/bin/python",
                        "-m",
                        "pip",
                        "install",
                        "--no-input",
                        "--disable-pip-version-check",
                        *spec.pip_args,
                        *missing,
                    ),
                )
            )
    return steps


def finish_step(vmid: int, config: Lines) -> Step | None:
    """The last step: OWNER_TAG in place of UNFINISHED_TAG (None when already so)."""
    tags = cfg.tags(config)
    if OWNER_TAG in tags and UNFINISHED_TAG not in tags:
        return None
    final = ";".join([*(t for t in tags if t not in (OWNER_TAG, UNFINISHED_TAG)), OWNER_TAG])
    return Step(f"mark container {vmid} finished (tags {final})", "host", ("pct", "set", str(vmid), "--tags", final))
