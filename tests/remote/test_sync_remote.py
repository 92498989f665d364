"""Sync into a container over ssh+pct: only changed files travel, releases are complete, guards hold."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from remote_harness import Harness

from dflashops.core.errors import Conflict
from dflashops.core.inventory import load_inventory
from dflashops.ops.invocation import Invocation
from dflashops.ops.releases.sync import release_files, sync


def test_one_changed_file_travels_alone_and_the_release_is_complete(inventory: Path, harness: Harness) -> None:
    inv = load_inventory(inventory)
    files = inv.profile("work").files
    invocation = Invocation(inv)
    try:
        agent = invocation.agent(inv.target("ct200"))
        first = sync(agent, extra_files=files, extra_root=inv.root)
        assert sync(agent, extra_files=files, extra_root=inv.root).uploaded == ()  # nothing changed
        (inventory.parent / "workload.py").write_text((inventory.parent / "workload.py").read_text() + "# edit\n")
        second = sync(agent, extra_files=files, extra_root=inv.root)
    finally:
        invocation.close()
    assert second.uploaded == ("workload.py",) and second.code_hash != first.code_hash
    release = harness.container_path("200", second.release_path)
    for rel, local in release_files(files, inv.root).items():
        assert (release / rel).read_bytes() == local.read_bytes(), rel
    assert os.readlink(release.parent / "current") == second.code_hash


def test_install_refuses_a_manifest_that_does_not_match_its_hash(inventory: Path, harness: Harness) -> None:
    inv = load_inventory(inventory)
    invocation = Invocation(inv)
    try:
        agent = invocation.agent(inv.target("ct200"))
        first = sync(agent, extra_files=inv.profile("work").files, extra_root=inv.root)
        empty_tar = io.BytesIO()
        tarfile.open(fileobj=empty_tar, mode="w").close()
        request = {
            "workspace": inv.target("ct200").workspace,
            "hash": "0123456789abcdef",
            "base": first.code_hash,
            "changed": {},
            "removed": ["workload.py"],
            "keep": 5,
        }
        with pytest.raises(Conflict, match="does not match release"):
            agent.call("install", request, stdin_tar=empty_tar.getvalue())
    finally:
        invocation.close()
    releases = harness.container_path("200", first.release_path).parent
    assert os.readlink(releases / "current") == first.code_hash
    assert not (releases / "0123456789abcdef").exists()
    assert json.loads((releases / first.code_hash / ".manifest.json").read_text())
