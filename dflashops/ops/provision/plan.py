"""The planner: desired state (a target's ProvisionSpec) + observed facts -> ordered steps. A pure function.

Two phases, because what is inside a container can only be read once it runs:
- `plan_host`: create or clone, one `pct set` with every config change (GPU device entries included), resize,
  start. Checks first, so a refusal changes nothing: a vmid taken by a container dflashops did not make (unless
  adopting), a missing template or clone source, a full storage, a GPU another container's config holds, a GPU
  the host lacks, a running container that would need a restart.
- `plan_container` (plan_container.py): the NVIDIA userspace of the host driver's exact version (no kernel module), the python venv
  and its pinned packages, the `nvidia-smi` check, then the tag that marks the container finished.

A step is a `pct` command on the host, a command in the container, or config lines that `pct` cannot set (the
`lxc.*` keys of hosts whose pct has no `devN`): those are shown, never written silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashops.core.errors import Conflict, NotFound
from dflashops.core.inventory import Target
from dflashops.core.inventory_provision import ProvisionSpec
from dflashops.ops.provision import config as cfg
from dflashops.ops.provision.config import OWNER_TAG, UNFINISHED_TAG, Lines

NVIDIA_MAJOR = 195  # /dev/nvidia[0-9]* and nvidiactl: fixed by the driver (nvidia-uvm's and nvidia-caps' vary)


@dataclass(frozen=True)
class DeviceNode:
    path: str
    major: int
    minor: int


@dataclass(frozen=True)
class HostFacts:
    """What the host says (facts.py reads it): None/empty where the host has no such thing."""

    host: str
    driver_version: str | None
    device_nodes: tuple[DeviceNode, ...]  # /dev/nvidia*, /dev/nvidia-caps/*
    char_majors: dict[str, int]  # /proc/devices' character devices: name -> major
    pct_has_dev: bool  # `pct help set` lists dev[n] (pve-container 5.1+, Proxmox VE 8.1+)
    containers: dict[int, Lines]  # every container's config, by vmid
    running: frozenset[int] = frozenset()
    templates: frozenset[str] = frozenset()  # volume ids `pveam list` shows for the template's storage
    storage_free_gb: float | None = None
    installer_present: bool = False

    def gpu_nodes(self) -> dict[int, DeviceNode]:
        out = {}
        for node in self.device_nodes:
            suffix = node.path.removeprefix("/dev/nvidia")
            if suffix.isdigit():
                out[int(suffix)] = node
        return out

    def control_nodes(self) -> list[DeviceNode]:
        """nvidiactl, nvidia-uvm, nvidia-uvm-tools and the nvidia-caps nodes, as the host has them."""
        names = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
        ordered = [node for name in names for node in self.device_nodes if node.path == name]
        return ordered + sorted(
            (n for n in self.device_nodes if n.path.startswith("/dev/nvidia-caps/")), key=lambda n: n.path
        )


@dataclass(frozen=True)
class ContainerFacts:
    """What the running container says; `nvidia_version` None when there is no working nvidia-smi."""

    nvidia_version: str | None = None
    gpu_count: int | None = None
    python3: bool = True
    venv_python: bool = False
    installed: frozenset[str] = frozenset()  # `pip freeze` lines, normalised (name lower-case, - for _)


@dataclass(frozen=True)
class Step:
    title: str  # the progress line
    where: str  # host: a pct argv on the host | container: argv inside | manual: config lines to add by hand
    argv: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()  # manual: the config lines
    check: bool = False  # a check changes nothing (a run with only checks "changed nothing")


@dataclass
class Plan:
    vmid: int
    before: list[str]  # the container's config lines (empty: it does not exist yet)
    after: list[str]
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said before the steps (adopting, finishing a half-made one)

    @property
    def changes(self) -> list[Step]:
        return [step for step in self.steps if not step.check]


def wanted_gpus(spec: ProvisionSpec, facts: HostFacts, vmid: int) -> list[DeviceNode]:
    nodes = facts.gpu_nodes()
    wanted = sorted(nodes) if spec.gpus is None else list(spec.gpus)
    missing = [gpu for gpu in wanted if gpu not in nodes]
    if missing:
        raise NotFound(
            f"{facts.host} has no /dev/nvidia{missing[0]} (its GPUs: {', '.join(map(str, sorted(nodes))) or 'none'})",
            hint="set provision.gpus to GPUs the host has (`nvidia-smi -L` on the host), or `all`",
        )
    for other, lines in sorted(facts.containers.items()):
        if other == vmid:
            continue
        held = set(cfg.dev_entries(lines).values()) | {
            entry.split()[0] for entry in cfg.values(lines, "lxc.mount.entry") if entry.strip()
        }
        for gpu in wanted:
            if nodes[gpu].path in held:
                raise Conflict(
                    f"GPU {gpu} ({nodes[gpu].path}) is passed to container {other} "
                    f"({cfg.value(lines, 'hostname') or '?'}) in its config",
                    hint=f"free it there (`pct config {other}` shows the line) or choose other provision.gpus",
                )
    return [nodes[gpu] for gpu in wanted]


def device_lines(nodes: list[DeviceNode], facts: HostFacts) -> tuple[dict[str, str], list[str]]:
    """The GPU entries: devN values (pct has devN) or the lxc.* lines of older hosts (majors from /proc/devices)."""
    if facts.pct_has_dev:
        return {node.path: f"{node.path},mode=0666" for node in nodes}, []
    # nvidia-uvm's and nvidia-caps' majors are given out at module load: /proc/devices says which (a node's own
    # number where /proc/devices lacks the name).
    named: dict[str, int] = {
        name: facts.char_majors[name] for name in ("nvidia-uvm", "nvidia-caps") if name in facts.char_majors
    }
    majors = sorted({NVIDIA_MAJOR, *named.values(), *(n.major for n in nodes if not _named(n, named))})
    lines = [f"lxc.cgroup2.devices.allow: c {major}:* rwm" for major in majors]
    lines += [f"lxc.mount.entry: {node.path} {node.path[1:]} none bind,optional,create=file" for node in nodes]
    return {}, lines


def _named(node: DeviceNode, named: dict[str, int]) -> bool:
    """Whether /proc/devices names the major of this node's kind (so that one is used)."""
    kind = "nvidia-caps" if node.path.startswith("/dev/nvidia-caps/") else "nvidia-uvm" if "uvm" in node.path else ""
    return kind in named


def plan_host(target: Target, spec: ProvisionSpec, facts: HostFacts, *, adopt: bool = False) -> Plan:
    """Steps that bring the container's config to `spec` and start it (see the module docstring)."""
    vmid = int(target.ctid or 0)
    current = facts.containers.get(vmid)
    plan = Plan(vmid=vmid, before=cfg.render(current) if current else [], after=[])
    pct = ("pct",)
    if current is not None:
        owned = {OWNER_TAG, UNFINISHED_TAG} & set(cfg.tags(current))
        if not owned and not adopt:
            raise Conflict(
                f"vmid {vmid} on {facts.host} is taken by container {cfg.value(current, 'hostname') or '?'!r}, "
                "which dflashops did not create",
                hint=f"pass --adopt to take it over (tags it {OWNER_TAG}), or give the target another ctid",
            )
        if not owned:
            plan.notes.append(f"adopting container {vmid} (tagging it {OWNER_TAG})")
        if UNFINISHED_TAG in cfg.tags(current):
            plan.notes.append(f"container {vmid} was left unfinished by an earlier run: finishing it")
        unpriv = cfg.value(current, "unprivileged") == "1"
        if unpriv != spec.unprivileged:
            raise Conflict(
                f"container {vmid} is {'un' if unpriv else ''}privileged; the inventory asks otherwise",
                hint="this cannot change after creation: set provision.unprivileged to match, or make a new one",
            )
    gpus = wanted_gpus(spec, facts, vmid)
    nodes = gpus + (facts.control_nodes() if gpus else [])
    dev_values, lxc_lines = device_lines(nodes, facts)
    base_tags = [t for t in cfg.tags(current or ()) if t not in (OWNER_TAG, UNFINISHED_TAG)]
    working_tags = ";".join([*base_tags, UNFINISHED_TAG])
    if current is None:
        current = _create(plan, target, spec, facts, working_tags)
    wanted: dict[str, str] = {
        "hostname": spec.hostname,
        "cores": str(spec.cores),
        "memory": str(spec.memory_mb),
        "swap": str(spec.swap_mb),
    }
    if _net_differs(cfg.value(current, "net0"), spec.network):
        wanted["net0"] = spec.network
    present_devs = cfg.dev_entries(current)
    delete = {
        f"dev{i}" for i, path in present_devs.items() if path.startswith("/dev/nvidia") and path not in dev_values
    }
    free = (i for i in range(256) if i not in present_devs)
    for path, entry in dev_values.items():
        index = next((i for i, p in present_devs.items() if p == path), None)
        key = f"dev{index if index is not None else next(free)}"
        if cfg.value(current, key) != entry:
            wanted[key] = entry
    changes = {k: v for k, v in wanted.items() if cfg.value(current, k) != v}
    have_tags = set(cfg.tags(current))
    if (changes or delete or not have_tags & {OWNER_TAG, UNFINISHED_TAG}) and UNFINISHED_TAG not in have_tags:
        changes["tags"] = working_tags  # unfinished until the last step: a crash in between is seen next time
    config_changes = {k for k in changes if k != "tags"} | delete
    if config_changes and vmid in facts.running:
        raise Conflict(
            f"container {vmid} is running and its config needs changes ({', '.join(sorted(config_changes))}), "
            "which take effect at its next start",
            hint=f"stop it when no run is active (`pct shutdown {vmid}` on {facts.host}), then provision again",
        )
    if changes or delete:
        argv = [*pct, "set", str(vmid)]
        for key, val in changes.items():
            argv += [f"--{key}", val]
        if delete:
            argv += ["--delete", ",".join(sorted(delete))]
        plan.steps.append(
            Step(f"configure container {vmid} ({', '.join([*changes, *sorted(delete)])})", "host", tuple(argv))
        )
        current = cfg.with_changes(current, changes, delete)
    have_gb = cfg.disk_gb(current)
    if have_gb is not None and have_gb + 1e-6 < spec.disk_gb:
        plan.steps.append(
            Step(
                f"grow the root disk to {spec.disk_gb} GiB",
                "host",
                (*pct, "resize", str(vmid), "rootfs", f"{spec.disk_gb}G"),
            )
        )
        current = cfg.with_changes(
            current, {"rootfs": _resized(cfg.value(current, "rootfs") or "", spec.disk_gb)}, set()
        )
    elif have_gb is not None and have_gb > spec.disk_gb + 1e-6:
        plan.notes.append(f"the root disk is {have_gb:g} GiB, more than disk_gb {spec.disk_gb} (disks never shrink)")
    have_lines = set(cfg.render(current))
    missing_lines = [line for line in lxc_lines if line not in have_lines]
    if missing_lines:
        plan.steps.append(
            Step(f"add the GPU lines pct cannot set to /etc/pve/lxc/{vmid}.conf", "manual", lines=tuple(missing_lines))
        )
        added = tuple((key.strip(), val.strip()) for key, _, val in (line.partition(":") for line in missing_lines))
        current = (*current, *added)
    if vmid not in facts.running:
        plan.steps.append(Step(f"start container {vmid}", "host", (*pct, "start", str(vmid))))
    plan.after = cfg.render(current)
    return plan


def _create(plan: Plan, target: Target, spec: ProvisionSpec, facts: HostFacts, tags: str) -> Lines:
    vmid = str(target.ctid)
    if spec.clone is not None:
        source = facts.containers.get(spec.clone)
        if source is None:
            raise NotFound(
                f"clone source {spec.clone} does not exist on {facts.host}",
                hint="provision.clone names a container (usually a template) on the same host: `pct list` shows them",
            )
        plan.steps.append(
            Step(
                f"clone container {spec.clone} to {vmid}",
                "host",
                (
                    "pct",
                    "clone",
                    str(spec.clone),
                    vmid,
                    "--hostname",
                    spec.hostname,
                    "--full",
                    "1",
                    "--storage",
                    spec.storage,
                ),
            )
        )
        net = ",".join(p for p in (cfg.value(source, "net0") or "").split(",") if not p.startswith("hwaddr="))
        kept = tuple((k, v) for k, v in source if k not in ("hostname", "tags", "net0", "template"))
        return (*kept, ("hostname", spec.hostname), ("net0", net))
    assert spec.template is not None
    storage = spec.template.split(":", 1)[0]
    if spec.template not in facts.templates:
        filename = spec.template.split("/", 1)[1]
        raise NotFound(
            f"template {spec.template} is not on {facts.host}'s storage {storage!r}",
            hint=f"fetch it on the host: pveam update && pveam download {storage} {filename}",
        )
    if facts.storage_free_gb is not None and facts.storage_free_gb < spec.disk_gb:
        raise Conflict(
            f"storage {spec.storage!r} on {facts.host} has {facts.storage_free_gb:.1f} GiB free, "
            f"the container's disk needs {spec.disk_gb} GiB",
            hint="free space there (`pvesm status` shows it), or set provision.storage / disk_gb",
        )
    argv = (
        "pct", "create", vmid, spec.template, "--hostname", spec.hostname, "--cores", str(spec.cores),
        "--memory", str(spec.memory_mb), "--swap", str(spec.swap_mb), "--net0", spec.network,
        "--rootfs", f"{spec.storage}:{spec.disk_gb}", "--unprivileged", "1" if spec.unprivileged else "0",
        "--features", "nesting=1", "--tags", tags,
    )  # fmt: skip
    plan.steps.append(Step(f"create container {vmid} from {spec.template}", "host", argv))
    return (
        ("cores", str(spec.cores)), ("features", "nesting=1"), ("hostname", spec.hostname),
        ("memory", str(spec.memory_mb)), ("net0", spec.network), ("rootfs", f"{spec.storage}:vm-{vmid}-disk-0,size={spec.disk_gb}G"),
        ("swap", str(spec.swap_mb)), ("tags", tags), ("unprivileged", "1" if spec.unprivileged else "0"),
    )  # fmt: skip


def _net_differs(current: str | None, wanted: str) -> bool:
    """net0 as Proxmox stores it carries a generated hwaddr (and type=veth): compare the keys the inventory sets."""
    have = dict(p.partition("=")[::2] for p in (current or "").split(",") if p)
    return any(have.get(k) != v for k, v in (p.partition("=")[::2] for p in wanted.split(",")))


def _resized(rootfs: str, gb: int) -> str:
    parts = [p for p in rootfs.split(",") if not p.startswith("size=")]
    return ",".join([*parts, f"size={gb}G"])
