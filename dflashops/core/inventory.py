"""The only reader of inventory.yaml: typed, validated, unknown keys rejected.

Errors name the file, the line and the key (`inventory.yaml:12: targets.gpu1.gpus: expected a list of
integers`). The file's sections:

    hosts:     {NAME: {address, user, port, identity_file, jump_host, known_hosts, sudo}}
    targets:   {NAME: {kind: local|pct|direct|host, host, ctid, gpus, workspace, python, env, address,
                       provision}}   (provision: the container itself, pct only: inventory_provision.py)
    profiles:  {NAME: {argv: [...], env: {...}, pass_env: [...], files: [...], packages: [...],
                       resume_args: [...], check: [...], check_timeout, description, on_failure, stall}}
                       (packages default to [trainer]; check: inventory.py _profile)
    notify:    {webhook | webhook_env, command, events, from_target, timeout}   (inventory_policy.py)
    groups:    {NAME: {targets: [...], master_addr, master_port}}   (inventory_groups.py: multi-node runs)

`local` targets resolve relative `workspace`/`python` paths against the inventory's directory. Profile argv
items may use the placeholders {python} {release} {run_dir} {workspace} {name} {gpus}, and for runs on several
targets {nnodes} {node_rank} {master_addr} {master_port} {rdzv_id} (1, 0, 127.0.0.1, ... on one); `resume_args` may use
{checkpoint}, and `check` the same placeholders as argv. Where the inventory is found: `--inventory PATH`, else $DFLASHOPS_INVENTORY, else the first
inventory.yaml in the current directory or its parents, else the one shipped next to the package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from dflashops.core.errors import InventoryError, NotFound
from dflashops.core.inventory_groups import Group, parse_groups
from dflashops.core.inventory_policy import Notify, OnFailure, Stall, parse_notify, parse_on_failure, parse_stall
from dflashops.core.inventory_provision import ProvisionSpec, parse_provision
from dflashops.core.shell import ENV_KEY_RE, is_safe_name
from dflashops.core.yaml_files import YAML_HINT, describe_yaml_error, read_yaml_text

TARGET_KINDS = ("local", "pct", "direct", "host")


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    jump_host: str | None = None
    known_hosts: str | None = None
    sudo: bool = False
    gateway: Host | None = None  # the `jump_host` entry, resolved by load_inventory (ProxyJump)


@dataclass(frozen=True)
class Target:
    """Where runs go: `local` (a folder here), `pct` (an LXC container on `host`), `direct` (a container
    with its own sshd, `host` names it) or `host` (a plain GPU server)."""

    name: str
    kind: str
    workspace: str
    python: str = "python3"
    host: Host | None = None
    ctid: int | None = None
    gpus: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    address: str | None = None  # where the other nodes of a multi-node run reach this target (inventory_groups)
    # Keep a `python -m trainer` interpreter with its imports done waiting for the next launch (agent/standby.py).
    standby: bool = False
    standby_idle_s: int = 3600  # an unused standby exits after this long
    # The compile caches' root (trainer/core/compile_cache.py), default <workspace>/cache/compile: a folder shared by
    # several workspaces or containers of one GPU kind (a bind mount) lets each start warm from the others' work.
    compile_cache: str | None = None
    provision: ProvisionSpec | None = None  # the container `dflashops provision` makes (pct targets only)

    @property
    def compile_cache_root(self) -> str:
        return self.compile_cache or f"{self.workspace}/cache/compile"


@dataclass(frozen=True)
class Profile:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    pass_env: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    resume_args: tuple[str, ...] = ()
    description: str = ""
    packages: tuple[str, ...] = ("trainer",)  # Python packages from the repository shipped in the release
    on_failure: OnFailure | None = None  # auto-restart by the in-container supervisor (inventory_policy.py)
    stall: Stall | None = None  # stall detection by the same supervisor
    # A command that exits 0 when a job other than the trainer can start (the same placeholders as argv; the run's
    # `--` extra arguments are appended). The pre-flight runs it in the new release, before a restart stops the
    # old run; a job with none cannot be checked, so restart stops its live parent only when told (--unchecked).
    check: tuple[str, ...] = ()
    check_timeout: int = 120  # seconds; a check still running then is a refusal
    # When `deploy`/`restart` (without --detach) call the run started (ops/runs/start_wait.py): a status.json
    # timeline milestone of the trainer, or `settle` for any other job (alive after a short settle time).
    started_when: str = "settle"


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: dict[str, Host]
    targets: dict[str, Target]
    profiles: dict[str, Profile]
    notify: Notify | None = None  # run state changes to a webhook and/or a command (inventory_policy.py)
    groups: dict[str, Group] = field(default_factory=dict)  # targets that run one job together

    def nodes(self, spec: str | None) -> tuple[tuple[Target, ...], Group | None]:
        """The targets `spec` names, node 0 first: a group name, `a,b,...`, or one target (or None: the default
        target). Returns the group (a made-up one for `a,b`) when there are several, else None."""
        if spec is not None and spec in self.groups:
            group = self.groups[spec]
            return tuple(self.target(name) for name in group.targets), group
        if spec is not None and "," in spec:
            names = [name.strip() for name in spec.split(",")]
            if len(set(names)) != len(names) or "" in names:
                raise NotFound(
                    f"targets {spec!r}: name each target once, separated by commas",
                    hint=f"targets: {', '.join(sorted(self.targets))}",
                )
            return tuple(self.target(name) for name in names), Group(name=spec, targets=tuple(names))
        return (self.target(spec),), None

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def lineage_path(self) -> Path:
        """The lineage database lives next to the inventory."""
        return self.root / "lineage.sqlite"

    def target(self, name: str | None) -> Target:
        """The named target; with no name, the only target (or the one called `local`)."""
        if name is None:
            if len(self.targets) == 1:
                return next(iter(self.targets.values()))
            if "local" in self.targets:
                return self.targets["local"]
            raise NotFound("no target given", hint=f"name one of: {', '.join(sorted(self.targets))}")
        if name not in self.targets:
            raise NotFound(
                f"unknown target {name!r} in {self.path}",
                hint=f"targets: {', '.join(sorted(self.targets)) or '(none)'}",
            )
        return self.targets[name]

    def profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise NotFound(
                f"unknown profile {name!r} in {self.path}",
                hint=f"profiles: {', '.join(sorted(self.profiles)) or '(none)'}",
            )
        return self.profiles[name]


def find_inventory(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit).resolve()
    if os.environ.get("DFLASHOPS_INVENTORY"):
        return Path(os.environ["DFLASHOPS_INVENTORY"]).resolve()
    for folder in [Path.cwd(), *Path.cwd().parents]:
        if (folder / "inventory.yaml").is_file():
            return folder / "inventory.yaml"
    return Path(__file__).resolve().parents[2] / "inventory.yaml"  # the repository root, above dflashops/core/


class _Reader:
    """Walks the YAML node tree so every error can name its line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, node: yaml.Node | None, key: str, message: str) -> InventoryError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        return InventoryError(
            f"{self.path}{line}: {key}: {message}", hint="see the comments at the top of the shipped inventory.yaml"
        )

    def mapping(self, node: yaml.Node, key: str, allowed: set[str] | None = None) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, key, "expected a mapping")
        out: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):  # str() of a collection key would expand its aliases
                raise self.fail(key_node, key or "(top level)", "keys must be plain names, not lists or mappings")
            name = str(key_node.value)
            if allowed is not None and name not in allowed:
                raise self.fail(
                    key_node, f"{key}.{name}" if key else name, f"unknown key (allowed: {', '.join(sorted(allowed))})"
                )
            if name in out:
                raise self.fail(key_node, f"{key}.{name}", "duplicate key")
            out[name] = value_node
        return out

    def scalar(self, node: yaml.Node, key: str, kind: type) -> Any:
        value = yaml.safe_load(yaml.serialize(node)) if isinstance(node, yaml.ScalarNode) else None
        if (
            (kind is bool and isinstance(value, bool))
            or (kind is int and isinstance(value, int) and not isinstance(value, bool))
            or (kind is str and isinstance(value, (str, int, float)) and not isinstance(value, bool))
        ):
            return str(value) if kind is str else value
        raise self.fail(node, key, f"expected {kind.__name__}")

    def check_name(self, value: str, node: yaml.Node, key: str) -> str:
        """Names of hosts, targets and profiles reach command lines: same rule as run names."""
        if not is_safe_name(value):
            raise self.fail(node, key, "names use 1-64 characters from A-Z a-z 0-9 . _ -")
        return value

    def str_list(self, node: yaml.Node, key: str) -> tuple[str, ...]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, key, "expected a list of strings")
        return tuple(self.scalar(item, f"{key}[{i}]", str) for i, item in enumerate(node.value))

    def int_list(self, node: yaml.Node, key: str) -> tuple[int, ...]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, key, "expected a list of integers")
        return tuple(self.scalar(item, f"{key}[{i}]", int) for i, item in enumerate(node.value))

    def env(self, node: yaml.Node, key: str) -> dict[str, str]:
        env = {}
        for env_key, value in self.mapping(node, key).items():
            if not ENV_KEY_RE.match(env_key):
                raise self.fail(value, f"{key}.{env_key}", "invalid environment variable name")
            env[env_key] = self.scalar(value, f"{key}.{env_key}", str)
        return env


def load_inventory(path: str | os.PathLike[str] | None = None) -> Inventory:
    """Read and validate the inventory; any problem is an InventoryError naming file, line and key."""
    inv_path = find_inventory(str(path) if path else None)
    reader = _Reader(inv_path)
    try:
        text = read_yaml_text(inv_path, what="inventory")  # size, encoding, depth and alias bounds first
    except OSError as exc:
        raise InventoryError(
            f"cannot read inventory {inv_path}: {exc.strerror}", hint="pass --inventory PATH or set DFLASHOPS_INVENTORY"
        ) from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise InventoryError(describe_yaml_error(inv_path, exc), hint=YAML_HINT) from None
    if root is None:
        raise InventoryError(f"{inv_path}: the inventory is empty", hint="define at least one target")
    top = reader.mapping(root, "", {"hosts", "targets", "profiles", "notify", "groups"})
    host_nodes = reader.mapping(top["hosts"], "hosts") if "hosts" in top else {}
    hosts = _resolve_gateways(
        reader, {name: _host(reader, name, node) for name, node in host_nodes.items()}, host_nodes
    )
    targets = {
        name: _target(reader, inv_path.parent, hosts, name, node)
        for name, node in (reader.mapping(top["targets"], "targets") if "targets" in top else {}).items()
    }
    profiles = {
        name: _profile(reader, name, node)
        for name, node in (reader.mapping(top["profiles"], "profiles") if "profiles" in top else {}).items()
    }
    notify = parse_notify(reader, top["notify"]) if "notify" in top else None
    groups = parse_groups(reader, top["groups"], set(targets)) if "groups" in top else {}
    return Inventory(path=inv_path, hosts=hosts, targets=targets, profiles=profiles, notify=notify, groups=groups)


def _host(reader: _Reader, name: str, node: yaml.Node) -> Host:
    key = f"hosts.{reader.check_name(name, node, 'hosts')}"
    fields = reader.mapping(node, key, {"address", "user", "port", "identity_file", "jump_host", "known_hosts", "sudo"})
    if "address" not in fields:
        raise reader.fail(node, key, "missing required key 'address'")
    get = {
        k: reader.scalar(v, f"{key}.{k}", int if k == "port" else bool if k == "sudo" else str)
        for k, v in fields.items()
    }
    return Host(name=name, **get)


def _resolve_gateways(reader: _Reader, hosts: dict[str, Host], nodes: dict[str, yaml.Node]) -> dict[str, Host]:
    """Replace each `jump_host` name by the Host it names (`gateway`); unknown names and cycles are errors."""
    resolved: dict[str, Host] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> Host:
        if name in resolved:
            return resolved[name]
        host = hosts[name]
        if host.jump_host is not None:
            if host.jump_host not in hosts:
                raise reader.fail(nodes[name], f"hosts.{name}.jump_host", f"unknown host {host.jump_host!r}")
            if host.jump_host in chain:
                raise reader.fail(nodes[name], f"hosts.{name}.jump_host", "jump hosts form a cycle")
            host = replace(host, gateway=resolve(host.jump_host, (*chain, name)))
        resolved[name] = host
        return host

    return {name: resolve(name, (name,)) for name in hosts}


def _target(reader: _Reader, base: Path, hosts: dict[str, Host], name: str, node: yaml.Node) -> Target:
    key = f"targets.{name}"
    reader.check_name(name, node, key)
    fields = reader.mapping(
        node,
        key,
        {
            "kind",
            "host",
            "ctid",
            "gpus",
            "workspace",
            "python",
            "env",
            "address",
            "standby",
            "standby_idle_s",
            "compile_cache",
            "provision",
        },
    )
    for required in ("kind", "workspace"):
        if required not in fields:
            raise reader.fail(node, key, f"missing required key {required!r}")
    kind = reader.scalar(fields["kind"], f"{key}.kind", str)
    if kind not in TARGET_KINDS:
        raise reader.fail(fields["kind"], f"{key}.kind", f"must be one of {', '.join(TARGET_KINDS)}")
    workspace = reader.scalar(fields["workspace"], f"{key}.workspace", str)
    python = reader.scalar(fields["python"], f"{key}.python", str) if "python" in fields else "python3"
    host = None
    if kind == "local":
        workspace = str((base / workspace).resolve())
        if "/" in python:
            python = str((base / python).absolute())
    else:
        if "host" not in fields:
            raise reader.fail(node, key, f"a {kind} target needs 'host'")
        host_name = reader.scalar(fields["host"], f"{key}.host", str)
        if host_name not in hosts:
            raise reader.fail(fields["host"], f"{key}.host", f"unknown host {host_name!r}")
        host = hosts[host_name]
        if not workspace.startswith("/"):
            raise reader.fail(fields["workspace"], f"{key}.workspace", "must be an absolute path")
    ctid = reader.scalar(fields["ctid"], f"{key}.ctid", int) if "ctid" in fields else None
    if kind == "pct" and ctid is None:
        raise reader.fail(node, key, "a pct target needs 'ctid'")
    gpus = reader.int_list(fields["gpus"], f"{key}.gpus") if "gpus" in fields else ()
    env = reader.env(fields["env"], f"{key}.env") if "env" in fields else {}
    address = reader.scalar(fields["address"], f"{key}.address", str) if "address" in fields else None
    standby = reader.scalar(fields["standby"], f"{key}.standby", bool) if "standby" in fields else False
    idle_s = (
        reader.scalar(fields["standby_idle_s"], f"{key}.standby_idle_s", int) if "standby_idle_s" in fields else 3600
    )
    if idle_s < 1:
        raise reader.fail(fields["standby_idle_s"], f"{key}.standby_idle_s", "must be a positive number of seconds")
    compile_cache = None
    if "compile_cache" in fields:
        compile_cache = reader.scalar(fields["compile_cache"], f"{key}.compile_cache", str)
        if kind == "local":
            compile_cache = str((base / compile_cache).resolve())
        elif not compile_cache.startswith("/"):
            raise reader.fail(fields["compile_cache"], f"{key}.compile_cache", "must be an absolute path")
    provision = None
    if "provision" in fields:
        if kind != "pct":
            raise reader.fail(fields["provision"], f"{key}.provision", "only a pct target's container is provisioned")
        provision = parse_provision(reader, fields["provision"], f"{key}.provision", name, python)
    return Target(
        provision=provision,
        name=name,
        kind=kind,
        workspace=workspace,
        python=python,
        host=host,
        ctid=ctid,
        gpus=gpus,
        env=env,
        address=address,
        standby=standby,
        standby_idle_s=idle_s,
        compile_cache=compile_cache,
    )


STARTED_WHEN = ("preflight_done", "first_step", "settle")


def default_started_when(argv: tuple[str, ...]) -> str:
    """`first_step` for `python -m trainer train` (whose status.json keeps a timeline), else `settle`. Started
    means trained: for a resume, the checkpoint loaded and the first step after it ran. `preflight_done` (the
    arguments and inputs checked in the job) said "started" before the checkpoint was even read, so a child
    that then failed to load it was reported as started."""
    words = list(argv)
    for index, word in enumerate(words[:-2]):
        if word == "-m" and words[index + 1] == "trainer" and words[index + 2] == "train":
            return "first_step"
    return "settle"


def _profile(reader: _Reader, name: str, node: yaml.Node) -> Profile:
    key = f"profiles.{name}"
    reader.check_name(name, node, key)
    fields = reader.mapping(
        node,
        key,
        {
            "argv", "env", "pass_env", "files", "resume_args", "description", "packages", "on_failure", "stall",
            "started_when", "check", "check_timeout",
        },
    )  # fmt: skip
    if "argv" not in fields:
        raise reader.fail(node, key, "missing required key 'argv'")
    argv = reader.str_list(fields["argv"], f"{key}.argv")
    if not argv:
        raise reader.fail(fields["argv"], f"{key}.argv", "must not be empty")
    pass_env = reader.str_list(fields["pass_env"], f"{key}.pass_env") if "pass_env" in fields else ()
    for env_key in pass_env:
        if not ENV_KEY_RE.match(env_key):
            raise reader.fail(fields["pass_env"], f"{key}.pass_env", f"invalid environment variable name {env_key!r}")
    files = reader.str_list(fields["files"], f"{key}.files") if "files" in fields else ()
    for rel in files:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise reader.fail(fields["files"], f"{key}.files", f"{rel!r} must be a path inside the repository")
    packages = reader.str_list(fields["packages"], f"{key}.packages") if "packages" in fields else ("trainer",)
    for package in packages:
        if not package.isidentifier():
            raise reader.fail(fields["packages"], f"{key}.packages", f"{package!r} is not a package name")
    started_when = default_started_when(argv)
    if "started_when" in fields:
        started_when = reader.scalar(fields["started_when"], f"{key}.started_when", str)
        if started_when not in STARTED_WHEN:
            raise reader.fail(
                fields["started_when"], f"{key}.started_when", f"must be one of {', '.join(STARTED_WHEN)}"
            )
    check = reader.str_list(fields["check"], f"{key}.check") if "check" in fields else ()
    if "check" in fields and not check:
        raise reader.fail(fields["check"], f"{key}.check", "must not be empty (a command, as a list of words)")
    check_timeout = (
        reader.scalar(fields["check_timeout"], f"{key}.check_timeout", int) if "check_timeout" in fields else 120
    )
    if check_timeout <= 0:
        raise reader.fail(fields["check_timeout"], f"{key}.check_timeout", "must be a positive number of seconds")
    if "check_timeout" in fields and not check:
        raise reader.fail(fields["check_timeout"], f"{key}.check_timeout", "needs check: (the command it limits)")
    return Profile(
        check=check,
        check_timeout=check_timeout,
        started_when=started_when,
        packages=packages,
        name=name,
        argv=argv,
        env=reader.env(fields["env"], f"{key}.env") if "env" in fields else {},
        pass_env=pass_env,
        files=files,
        resume_args=reader.str_list(fields["resume_args"], f"{key}.resume_args") if "resume_args" in fields else (),
        description=reader.scalar(fields["description"], f"{key}.description", str) if "description" in fields else "",
        on_failure=parse_on_failure(reader, fields["on_failure"], f"{key}.on_failure")
        if "on_failure" in fields
        else None,
        stall=parse_stall(reader, fields["stall"], f"{key}.stall") if "stall" in fields else None,
    )
