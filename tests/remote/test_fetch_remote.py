"""`dflashops fetch` through sshd -> sudo pct -> container, with the link cut halfway through a checkpoint
by the loopback proxy: the fetch continues from the bytes it has (the first half is not sent again),
verifies the sha256 computed in the container, and a fetch that cannot reconnect leaves only the hidden
partial, which the next fetch continues."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from conftest import cli
from loopproxy import LoopProxy
from remote_harness import Harness

CKPT_BYTES = 8 * 1024 * 1024


def finished_run(name: str) -> None:
    code, _, err = cli(
        "deploy",
        "--detach",
        "ct200",
        "--profile",
        "work",
        "--name",
        name,
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "3",
        "--interval",
        "0",
        "--save-every",
        "3",
        "--ckpt-bytes",
        str(CKPT_BYTES),
    )
    assert code == 0, err
    code, _, err = cli("logs", name, "-f", "--timeout", "60")
    assert code == 0, err


def container_sha(harness: Harness, inventory: Path, name: str, rel: str) -> str:
    path = harness.container_path("200", f"/workspace/{inventory.parent.name}/runs/{name}/{rel}")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_cut_at_half_continues_without_sending_the_first_half_again(
    proxied_inventory: Path, proxy: LoopProxy, harness: Harness, tmp_path: Path
) -> None:
    finished_run("rf1")
    dest = tmp_path / "dest"
    proxy.reset_counters()
    proxy.cut_after_down(CKPT_BYTES // 2)  # the small files and the agent calls before it are a few KB
    code, out, err = cli("fetch", "rf1", "--to", str(dest), "--json")
    assert code == 0, err
    model = next(f for f in json.loads(out)["files"] if f["path"].endswith("model.bin"))
    assert proxy.connections_cut == 1 and model["resumes"] == 1 and model["how"] == "resumed"
    kept = int(re.search(r"link lost at byte ([\d,]+)", err).group(1).replace(",", ""))
    assert 0 < kept < CKPT_BYTES
    # After the cut only what the client did not have came down again (plus one reconnect and the agent call);
    # bytes the proxy had counted but not delivered when it cut are part of that rest, not a re-send.
    after_cut = proxy.bytes_down - (proxy.bytes_down_at_cut or 0)
    assert after_cut < CKPT_BYTES - kept + 256 * 1024, (after_cut, kept)
    rel = "checkpoints/step_000003/model.bin"
    assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == container_sha(
        harness, proxied_inventory, "rf1", rel
    )


def test_a_fetch_that_cannot_reconnect_leaves_a_partial_the_next_one_continues(
    proxied_inventory: Path, proxy: LoopProxy, harness: Harness, tmp_path: Path
) -> None:
    finished_run("rf2")
    dest = tmp_path / "dest"
    final = dest / "checkpoints/step_000003/model.bin"
    partial = final.with_name(".model.bin.partial")
    proxy.cut_after_down(CKPT_BYTES // 2)
    original_cut_all = proxy.cut_all

    def cut_and_go_down() -> None:  # the host stays unreachable after the cut
        proxy.refuse = True
        original_cut_all()

    proxy.cut_all = cut_and_go_down  # type: ignore[method-assign]
    code, out, err = cli("fetch", "rf2", "--to", str(dest), "--retries", "1")
    assert code == 5 and out == "" and "error: checkpoints/step_000003/model.bin: transfer stopped at byte" in err
    assert "hint: run the same fetch again: it continues from byte" in err
    assert not final.exists() and 0 < partial.stat().st_size < CKPT_BYTES  # never under its final name
    kept = partial.stat().st_size

    proxy.cut_all, proxy.refuse = original_cut_all, False  # type: ignore[method-assign]
    proxy.reset_counters()
    code, out, err = cli("fetch", "rf2", "--to", str(dest), "--json")
    assert code == 0, err
    model = next(f for f in json.loads(out)["files"] if f["path"].endswith("model.bin"))
    assert model["how"] == "resumed" and model["sent"] == CKPT_BYTES - kept
    assert proxy.bytes_down < CKPT_BYTES - kept + 512 * 1024  # only the rest crossed the link
    rel = "checkpoints/step_000003/model.bin"
    assert hashlib.sha256(final.read_bytes()).hexdigest() == container_sha(harness, proxied_inventory, "rf2", rel)
    assert not partial.exists()
