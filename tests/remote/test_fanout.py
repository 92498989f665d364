"""`--all`: every target in parallel; a dead or hung host costs at most its timeout, others still answer."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from loopproxy import LoopProxy
from remote_harness import Harness, free_port


def fanout_inventory(tmp_path: Path, harness: Harness, hung_port: int) -> Path:
    extra = f"""\
        dead: {{kind: pct, host: deadhost, ctid: 200, workspace: /workspace/{tmp_path.name}}}
        hung: {{kind: pct, host: hunghost, ctid: 200, workspace: /workspace/{tmp_path.name}}}
        """
    path = write_inventory(
        tmp_path / "inventory.yaml", harness, workspace=f"/workspace/{tmp_path.name}", extra_targets=extra
    )
    text = path.read_text().replace(
        "targets:\n",
        f"""  deadhost:
    address: 127.0.0.1
    port: {free_port()}
    user: {harness.user}
    identity_file: {harness.client_key}
    known_hosts: {harness.known_hosts}
  hunghost:
    address: 127.0.0.1
    port: {hung_port}
    user: {harness.user}
    identity_file: {harness.client_key}
    known_hosts: {harness.known_hosts}
targets:
""",
        1,
    )
    path.write_text(text)
    return path


def test_status_all_answers_for_every_target_within_the_timeout(
    tmp_path: Path, harness: Harness, proxy: LoopProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy.stall()  # `hung` accepts TCP and then never answers
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(fanout_inventory(tmp_path, harness, proxy.port)))
    monkeypatch.setenv("DFLASHOPS_CONNECT_TIMEOUT", "30")  # longer than --all-timeout: the deadline must cut it
    code, out, err = cli(
        "deploy", "ct202", "--profile", "work", "--name", "fan-r1", "--wait", r"^step 1 ", "--timeout", "60"
    )
    assert code == 0, err
    before = set(threading.enumerate())
    code, out, err = cli("status", "--all", "--json", "--all-timeout", "2.5")
    # Bounded by the 2.5 s deadline, not by the hung host's 30 s connect timeout, shown by events rather than by
    # a clock (a loaded machine stretches any wall-time bound): the CLI returned while the hung host's worker was
    # still inside its connect, and the row says the deadline, not the host, ended it.
    hung_workers = [t for t in set(threading.enumerate()) - before if t.name == "fanout-hung"]
    assert len(hung_workers) == 1 and hung_workers[0].is_alive()
    rows = {row["target"]: row for row in json.loads(out)["targets"]}
    assert code == 1
    assert rows["ct200"]["ok"] and rows["ct200"]["runs"] == []
    assert rows["ct202"]["ok"] and [r["name"] for r in rows["ct202"]["runs"]] == ["fan-r1"]
    assert "stopped" in rows["ct201"]["error"] and "does not exist" in rows["ct999"]["error"]
    assert "connection refused" in rows["dead"]["error"]
    assert rows["hung"]["timed_out"] and not rows["hung"]["ok"] and rows["hung"]["seconds"] == 2.5
    assert "no answer within 2.5s" in rows["hung"]["error"]

    monkeypatch.setenv("NO_COLOR", "1")
    code, out, err = cli("status", "--all", "--all-timeout", "2.5")
    assert "fan-r1" in out and "running" in out and "timed out" in out and "\x1b[" not in out

    code, out, err = cli("exec", "--all", "--all-timeout", "2.5", "--", "sh", "-c", "echo $$")
    assert "[ct200] " in out and "[ct202] " in out and "[dead] error: cannot reach" in err

    code, out, err = cli("stop", "--all", "--grace", "2", "--all-timeout", "2.5")
    assert "fan-r1" in out and code == 1  # stopped on ct202; the broken targets are listed as errors
    entry = json.loads(cli("status", "fan-r1", "--json")[1])["runs"][0]
    assert entry["state"] == "stopped"


def test_at_most_eight_targets_of_one_host_are_worked_on_at_once() -> None:
    """A host's sshd refuses the 11th connection being set up or the 11th channel by default: --all gates a host's
    targets (12 containers on `pve` here), while other hosts and the local target do not wait for it."""
    from dflashops.core.inventory import Host, Target
    from dflashops.ops.fleet.fanout import PER_HOST_LIMIT, fan_out

    pve, other = Host("pve", "127.0.0.1"), Host("other", "127.0.0.2")
    targets = [Target(f"ct{200 + i}", "pct", "/workspace", host=pve, ctid=200 + i) for i in range(12)]
    targets += [Target(f"o{i}", "pct", "/workspace", host=other, ctid=300 + i) for i in range(3)]
    targets.append(Target("here", "local", "/tmp/dfo-fanout-test"))
    lock, changed, release = threading.Lock(), threading.Condition(), threading.Event()
    active: dict[str, int] = {}
    peak: dict[str, int] = {}
    entered = 0

    def work(target: Target) -> str:
        nonlocal entered
        host = target.host.name if target.host else "local"
        with lock:
            active[host] = active.get(host, 0) + 1
            peak[host] = max(peak.get(host, 0), active[host])
        with changed:
            entered += 1
            changed.notify_all()
        assert release.wait(60)
        with lock:
            active[host] -= 1
        return target.name

    results: list = []
    runner = threading.Thread(target=lambda: results.extend(fan_out(targets, work, timeout=120)))
    runner.start()
    with changed:  # all that may enter at once have entered: 8 of pve's, other's 3, the local one
        assert changed.wait_for(lambda: entered >= PER_HOST_LIMIT + 3 + 1, timeout=60)
    release.set()
    runner.join(120)
    assert PER_HOST_LIMIT == 8 and peak == {"pve": 8, "other": 3, "local": 1}
    assert [r.value for r in results] == [t.name for t in targets] and all(r.ok for r in results)
