"""Releases with a large file (issue 47), small: the laptop's manifest cache (size, mtime, inode), a plain tar for
incompressible bytes, and the target taking a hard-linked file's digest from its base release only while the
inode is as the base verified it. Real files, the agent's real install code; the timed figures are
bench/control_plane_scale.py's (bench/results/control-plane.md)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dflashops.agent import releases as agent_releases
from dflashops.agent.common import AgentFailure
from dflashops.ops.releases import sync
from dflashops.ops.releases.manifest_cache import ManifestCache
from dflashops.ops.upload import PlainTar

BIG = 9 << 20  # over sync.PLAIN_TAR_FROM_BYTES


def aged(path: Path, seconds: float = 60) -> Path:
    """Set the file's mtime in the past (older than the racy window: the cache may keep it)."""
    when = time.time() - seconds
    os.utime(path, (when, when))
    return path


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(BIG))
    (src / "train.py").write_text("print('step')\n")
    return {"data/big.bin": aged(src / "big.bin"), "trainer/train.py": aged(src / "train.py")}


def test_the_manifest_cache_hashes_a_file_again_only_when_it_changed(
    tree: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_path = tmp_path / "cache.json"
    read: list[str] = []
    real = sync.file_sha256

    def counted(path: Path) -> str:
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(sync, "file_sha256", counted)
    first = sync.local_manifest(tree, ManifestCache(cache_path))
    assert sorted(read) == ["big.bin", "train.py"] and cache_path.is_file()
    read.clear()
    assert sync.local_manifest(tree, ManifestCache(cache_path)) == first and read == []  # every digest a cache hit
    tree["trainer/train.py"].write_text("print('step!')\n")  # same size... one more byte: a new mtime anyway
    aged(tree["trainer/train.py"], 30)
    second = sync.local_manifest(tree, ManifestCache(cache_path))
    assert read == ["train.py"] and second[1]["trainer/train.py"] == real(tree["trainer/train.py"])
    read.clear()
    fresh = tree["trainer/train.py"]
    fresh.write_text("print('just now')\n")  # written now: hashed, and not kept (it may change in the same tick)
    sync.local_manifest(tree, ManifestCache(cache_path))
    sync.local_manifest(tree, ManifestCache(cache_path))
    assert read == ["train.py", "train.py"]


def install(workspace: Path, files: dict[str, Path], cache: Path, base: str | None, base_files: dict) -> tuple:
    code_hash, manifest = sync.local_manifest(files, ManifestCache(cache))
    payload = sync.install_payload(str(workspace), files, code_hash, manifest, base, base_files)
    request, upload, uploaded, linked = payload.request, payload.tar, payload.uploaded, payload.linked
    agent_releases.build_release(request, upload.open())  # as the agent reads it: a stream, `tar_bytes` long
    return code_hash, manifest, upload.read_bytes(), uploaded, linked


def test_incompressible_bytes_go_as_a_plain_tar_and_install_whole(tree: dict[str, Path], tmp_path: Path) -> None:
    code_hash, manifest, tar, uploaded, _ = install(tmp_path / "ws", tree, tmp_path / "c.json", None, {})
    assert tar[:2] != b"\x1f\x8b" and len(tar) >= BIG  # not gzip: 0% saved was 45 s at level 6
    release = tmp_path / "ws" / "releases" / code_hash
    assert (release / "data" / "big.bin").read_bytes() == tree["data/big.bin"].read_bytes()
    assert json.loads((release / ".manifest.json").read_text()) == manifest
    small = {"trainer/train.py": tree["trainer/train.py"]}
    _, _, tar, _, _ = install(tmp_path / "ws2", small, tmp_path / "c.json", None, {})
    assert tar[:2] == b"\x1f\x8b"  # small code still goes gzipped (the tar's 10 KiB padding costs nothing)


def test_a_linked_file_is_trusted_only_while_its_inode_is_as_verified(
    tree: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace, cache = tmp_path / "ws", tmp_path / "c.json"
    base, base_files, *_ = install(workspace, tree, cache, None, {})
    hashed: list[str] = []
    real = agent_releases.file_sha256

    def counted(path: str) -> str:
        hashed.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(agent_releases, "file_sha256", counted)
    tree["trainer/train.py"].write_text("print('changed')\n")
    aged(tree["trainer/train.py"], 30)
    second, _, _, uploaded, linked = install(workspace, tree, cache, base, base_files)
    assert uploaded == ("trainer/train.py",) and "data/big.bin" in linked
    # The 9 MB file's digest came from the base's verified record, the uploaded file's from its bytes as they
    # were written: nothing was read back to be hashed.
    assert hashed == []
    # The base's copy changed in place (the same inode, a new mtime): the next release built on it hashes it,
    # and refuses it, since it no longer holds what the manifest says.
    with open(workspace / "releases" / second / "data" / "big.bin", "r+b") as handle:
        handle.write(b"tampered")
    hashed.clear()
    tree["trainer/train.py"].write_text("print('again')\n")
    aged(tree["trainer/train.py"], 20)
    second_files = json.loads((workspace / "releases" / second / ".manifest.json").read_text())
    with pytest.raises(AgentFailure, match="'data/big.bin' is missing or corrupt"):
        install(workspace, tree, cache, second, second_files)
    assert "big.bin" in hashed


def test_an_uploaded_file_is_checked_as_it_is_written_and_keeps_its_mode(tree: dict[str, Path], tmp_path: Path) -> None:
    """The digest taken while a file is unpacked is the one checked against the manifest: bytes that differ from
    what the manifest names are refused (nothing is left of the release), and a script keeps its mode."""
    tree["trainer/train.py"].chmod(0o755)
    small = {"trainer/train.py": tree["trainer/train.py"]}
    code_hash, manifest = sync.local_manifest(small, ManifestCache(tmp_path / "c.json"))
    payload = sync.install_payload(str(tmp_path / "ws"), small, code_hash, manifest, None, {})
    request, upload = payload.request, payload.tar
    other = tmp_path / "other.py"
    other.write_text("print('not what the manifest names')\n")
    swapped = io.BytesIO()
    with tarfile.open(fileobj=swapped, mode="w:gz") as archive:
        archive.add(other, arcname="trainer/train.py")
    with pytest.raises(AgentFailure, match="'trainer/train.py' is missing or corrupt"):
        agent_releases.build_release(replace(request, tar_bytes=len(swapped.getvalue())), swapped.getvalue())
    assert [p.name for p in (tmp_path / "ws" / "releases").iterdir()] == []
    agent_releases.build_release(request, upload.open())
    installed = tmp_path / "ws" / "releases" / code_hash / "trainer" / "train.py"
    assert installed.read_bytes() == tree["trainer/train.py"].read_bytes() and installed.stat().st_mode & 0o777 == 0o755


def test_a_generated_plain_tar_is_the_bytes_tarfile_writes(tmp_path: Path) -> None:
    """PlainTar (a large incompressible upload, generated as it is sent) gives byte for byte what tarfile's `w` mode
    writes for the same files, its announced size included: a name past 100 characters (a pax header), an empty
    file, one not a multiple of 512 bytes, a script's mode."""
    long_name = "data/" + "n" * 140 + ".bin"
    members = {long_name: os.urandom(3000), "data/empty": b"", "trainer/run.sh": b"#!/bin/sh\necho hi\n"}
    files: dict[str, Path] = {}
    for index, (rel, data) in enumerate(members.items()):
        files[rel] = tmp_path / f"f{index}"
        files[rel].write_bytes(data)
    files["trainer/run.sh"].chmod(0o755)
    generated = PlainTar()
    for rel, path in files.items():
        generated.add(rel, path)
    written = io.BytesIO()
    with tarfile.open(fileobj=written, mode="w") as archive:
        for rel, path in files.items():
            with path.open("rb") as handle:
                info = archive.gettarinfo(arcname=rel, fileobj=handle)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                archive.addfile(info, handle)
    assert generated.read_bytes() == written.getvalue() and len(generated) == len(written.getvalue())


def test_a_file_cut_after_the_tar_was_planned_is_refused_not_hung(tree: dict[str, Path], tmp_path: Path) -> None:
    """The tar's size is announced before it is sent: a file cut short meanwhile goes as the size its header
    names (zeros after its end), and the agent's digest check refuses it (nothing is made current), instead of a
    stream that fails mid-call."""
    code_hash, manifest = sync.local_manifest(tree, ManifestCache(tmp_path / "c.json"))
    payload = sync.install_payload(str(tmp_path / "ws"), tree, code_hash, manifest, None, {})
    request, upload = payload.request, payload.tar
    assert isinstance(upload, PlainTar)
    os.truncate(tree["data/big.bin"], BIG // 2)
    body = upload.read_bytes()
    assert len(body) == request.tar_bytes
    with pytest.raises(AgentFailure, match="'data/big.bin' is missing or corrupt"):
        agent_releases.build_release(request, body)
    assert list((tmp_path / "ws" / "releases").iterdir()) == []


# The controller's whole path of a first deploy's upload (manifest, then install through the local transport to the
# real agent), in a child interpreter so that its high-water marks of memory are this upload's alone. `UPLOAD_MB`
# of random bytes: the tar of it was held whole on both sides (the controller: a BytesIO, then request + tar
# joined in a second copy; the agent: all of stdin read, then split), so each side's peak grew by 1-2x the upload.
UPLOAD_MB = 64
SYNC_CHILD = """
import json, resource, sys
from pathlib import Path
from dflashops.core.inventory import Target
from dflashops.ops.agent_client import Agent
from dflashops.ops.releases import sync
from dflashops.transport.local import LocalTransport
src, workspace = Path(sys.argv[1]), sys.argv[2]
agent = Agent(Target(name="local", kind="local", workspace=workspace, python=sys.executable), LocalTransport())
agent.ensure()  # the agent's upload first: its bytes are not the release's
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
outcome = sync.sync(agent, extra_files=("big.bin",), extra_root=src, packages=())
print(json.dumps({"hash": outcome.code_hash, "tar_bytes": outcome.tar_bytes,
                  "controller_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
                  "agent_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def test_a_large_upload_is_streamed_not_held_whole_on_either_side(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(UPLOAD_MB << 20))
    workspace = tmp_path / "ws"
    done = subprocess.run(
        [sys.executable, "-c", SYNC_CHILD, str(src), str(workspace)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert seen["tar_bytes"] >= UPLOAD_MB << 20  # a plain tar of random bytes: the whole file went
    release = workspace / "releases" / seen["hash"]
    assert (release / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    # Each side's peak grows by a few MiB of buffers, not by the upload (a bound of a quarter of it leaves room
    # for the interpreter's own ~20-40 MiB in the agent, whose peak is absolute).
    quarter_kib = (UPLOAD_MB << 10) // 4
    assert seen["controller_kib"] < quarter_kib, seen
    assert seen["agent_kib"] < (UPLOAD_MB << 10) // 2 + quarter_kib // 2, seen


def test_an_install_that_uploads_the_agent_first_sends_its_tar_again_from_the_start(
    tree: dict[str, Path], tmp_path: Path
) -> None:
    """The first call to a target without this agent version fails ("can't open file"), the agent is uploaded and
    the call runs again: its stdin, the request line and the tar read from a file, is sent again whole."""
    from dflashops.core.inventory import Target
    from dflashops.ops.agent_client import Agent
    from dflashops.transport.local import LocalTransport

    workspace = tmp_path / "ws"
    agent = Agent(Target(name="local", kind="local", workspace=str(workspace), python=sys.executable), LocalTransport())
    code_hash, manifest = sync.local_manifest(tree, ManifestCache(tmp_path / "c.json"))
    payload = sync.install_payload(str(workspace), tree, code_hash, manifest, None, {})
    request, upload = payload.request, payload.tar
    assert not Path(agent.path).exists()
    answer = agent.call("install", request, stdin_tar=upload)  # no ensure(): the optimistic first call
    assert answer["release"] == code_hash and Path(agent.path).exists()
    assert (workspace / "releases" / code_hash / "data" / "big.bin").read_bytes() == tree["data/big.bin"].read_bytes()
