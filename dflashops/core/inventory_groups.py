"""The inventory's `groups`: several targets that run ONE job together (torchrun, one process per node).

    targets:
      ct200: {kind: pct, host: pve1, ctid: 200, workspace: /workspace, address: 10.0.0.200}
      ct201: {kind: pct, host: pve2, ctid: 201, workspace: /workspace, address: 10.0.0.201}
    groups:
      pair: {targets: [ct200, ct201], master_port: 29500}       # master_addr: defaults to ct200's address

A target's `address` is where the OTHER nodes reach it (its own network, not the Proxmox host's); node 0 is the
group's first target and its address is the rendezvous (`master_addr`) unless the group names one. `deploy pair`
and `deploy ct200,ct201` both run one job on those targets; the profile's argv may use {nnodes}, {node_rank},
{master_addr}, {master_port} and {rdzv_id} (the run name). Parsing goes through inventory.py's reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT


def parse_groups(reader: Any, node: Any, target_names: set[str]) -> dict[str, Group]:
    groups: dict[str, Group] = {}
    for name, entry in reader.mapping(node, "groups").items():
        key = f"groups.{name}"
        reader.check_name(name, entry, key)
        if name in target_names:
            raise reader.fail(entry, key, f"{name!r} is also a target name; a group needs a name of its own")
        fields = reader.mapping(entry, key, {"targets", "master_addr", "master_port"})
        if "targets" not in fields:
            raise reader.fail(entry, key, "missing required key 'targets'")
        members = reader.str_list(fields["targets"], f"{key}.targets")
        for member in members:
            if member not in target_names:
                raise reader.fail(fields["targets"], f"{key}.targets", f"unknown target {member!r}")
        if len(members) < 2 or len(set(members)) != len(members):
            raise reader.fail(fields["targets"], f"{key}.targets", "needs two or more different targets")
        port = (
            reader.scalar(fields["master_port"], f"{key}.master_port", int)
            if "master_port" in fields
            else DEFAULT_MASTER_PORT
        )
        if not 1 <= port <= 65535:
            raise reader.fail(fields["master_port"], f"{key}.master_port", "must be a TCP port (1-65535)")
        address = reader.scalar(fields["master_addr"], f"{key}.master_addr", str) if "master_addr" in fields else None
        groups[name] = Group(name=name, targets=members, master_addr=address, master_port=port)
    return groups
