"""Bad `groups:` in the inventory (runs on several targets): one `FILE:LINE: key: ...` error each."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dflashops.errors import InventoryError, NotFound
from dflashops.inventory import load_inventory
from dflashops.ops.nodes import nodes_of

TARGETS = """\
targets:
  a: {kind: local, workspace: wa}
  b: {kind: local, workspace: wb}
"""


@pytest.mark.parametrize("groups, words", [
    ("g: {targets: [a, zz]}", "groups.g.targets: unknown target 'zz'"),
    ("g: {targets: [a]}", "needs two or more different targets"),
    ("g: {targets: [a, a]}", "needs two or more different targets"),
    ("a: {targets: [a, b]}", "is also a target name"),
    ("g: {targets: [a, b], master_port: 70000}", "must be a TCP port"),
    ("g: {targets: [a, b], colour: red}", "unknown key"),
    ("g: {master_port: 1}", "missing required key 'targets'"),
])
def test_bad_groups_are_refused_with_file_and_line(tmp_path: Path, groups: str, words: str) -> None:
    (tmp_path / "inventory.yaml").write_text(TARGETS + "groups:\n  " + groups + "\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory(tmp_path / "inventory.yaml")
    assert caught.value.message.startswith(f"{tmp_path / 'inventory.yaml'}:5: ") and words in caught.value.message


def test_nodes_of_a_spec(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text(TARGETS + "groups:\n  g: {targets: [b, a], master_port: 29611}\n")
    inventory = load_inventory(tmp_path / "inventory.yaml")
    targets, group = inventory.nodes("g")
    assert [t.name for t in targets] == ["b", "a"] and group is not None and group.master_port == 29611
    targets, group = inventory.nodes("a,b")
    assert [t.name for t in targets] == ["a", "b"] and group is not None and group.targets == ("a", "b")
    assert inventory.nodes("a")[1] is None
    with pytest.raises(NotFound):
        inventory.nodes("a,a")
    with pytest.raises(NotFound):
        inventory.nodes("a,zz")


def test_a_run_whose_node_target_left_the_inventory_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text(TARGETS)
    inventory = load_inventory(tmp_path / "inventory.yaml")
    record = SimpleNamespace(extra={"nodes": [{"rank": 0, "target": "a"}, {"rank": 1, "target": "gone"}]})
    invocation: Any = SimpleNamespace(inventory=inventory, record_of=lambda name: record)  # what nodes_of reads
    with pytest.raises(NotFound) as caught:
        nodes_of(invocation, "r1")
    assert "target 'gone', which is not in" in caught.value.message
    assert str(tmp_path / "inventory.yaml") in caught.value.message
