"""Bad `groups:` in the inventory (runs on several targets): one `FILE:LINE: key: ...` error each."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashops.core.errors import InventoryError, NotFound
from dflashops.core.inventory import load_inventory
from dflashops.lineage import RunRecord
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.nodes import nodes_of

TARGETS = """\
targets:
  a: {kind: local, workspace: wa}
  b: {kind: local, workspace: wb}
"""


@pytest.mark.parametrize(
    "groups, words",
    [
        ("g: {targets: [a, zz]}", "groups.g.targets: unknown target 'zz'"),
        ("g: {targets: [a]}", "needs two or more different targets"),
        ("g: {targets: [a, a]}", "needs two or more different targets"),
        ("a: {targets: [a, b]}", "is also a target name"),
        ("g: {targets: [a, b], master_port: 70000}", "must be a TCP port"),
        ("g: {targets: [a, b], colour: red}", "unknown key"),
        ("g: {master_port: 1}", "missing required key 'targets'"),
    ],
)
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


def test_a_node_whose_target_left_the_inventory_is_named(tmp_path: Path) -> None:
    """A run on several targets whose lineage names a target the inventory no longer has: NotFound naming the
    node, the target and the inventory file."""
    (tmp_path / "inventory.yaml").write_text(TARGETS)
    invocation = Invocation(load_inventory(tmp_path / "inventory.yaml"))
    try:
        invocation.db.record(
            RunRecord(
                name="multi", target="a", extra={"nodes": [{"rank": 0, "target": "a"}, {"rank": 1, "target": "gone"}]}
            )
        )
        with pytest.raises(NotFound) as caught:
            nodes_of(invocation, "multi")
        assert caught.value.message == (
            f"node 1 of run 'multi' was on target 'gone', which is not in {tmp_path / 'inventory.yaml'}"
        )
    finally:
        invocation.close()
