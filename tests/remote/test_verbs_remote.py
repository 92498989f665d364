"""The whole verb set through sshd -> sudo pct -> container, via the real CLI entry point."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import cli, write_inventory
from remote_harness import Harness, free_port


def workspace_of(inventory: Path) -> str:
    return f"/workspace/{inventory.parent.name}"


def test_deploy_status_logs_restart_stop_runs_exec(inventory: Path, harness: Harness) -> None:
    code, out, err = cli(
        "deploy", "ct200", "--profile", "work", "--name", "rem-a1", "--wait", r"^step 3 ", "--timeout", "60"
    )
    assert code == 0, err
    assert out.splitlines()[0] == "rem-a1"
    decoy = harness.in_container(
        "200", "sh", "-c", "python3 -c 'import time; time.sleep(600)' </dev/null >/dev/null 2>&1 & echo $!"
    ).stdout.strip()
    try:
        code, out, err = cli("status", "rem-a1", "--json")
        assert code == 0, err
        assert json.loads(out)["runs"][0]["state"] == "running"

        code, out, err = cli("logs", "rem-a1")
        assert code == 0 and "step 1 loss" in out

        code, out, err = cli("restart", "rem-a1", "--grace", "10", "--wait", r"^step 2 ", "--timeout", "60")
        assert code == 0, err
        child = out.splitlines()[0]
        assert child == "rem-a2"

        parent_entry = json.loads(cli("status", "rem-a1", "--json")[1])["runs"][0]
        assert parent_entry["state"] == "stopped" and parent_entry["exit_code"] == 143  # clean SIGTERM path

        code, out, err = cli("runs", "show", child, "--json")
        assert code == 0, err
        assert json.loads(out)["parent"] == "rem-a1"

        code, out, err = cli("stop", child, "--grace", "10")
        assert code == 0, err
        code, out, err = cli("stop", child)
        assert code != 0 and err.startswith("error: ")  # not running any more: refused, nothing signalled

        code, out, err = cli("logs", child, "-f", "--timeout", "30")
        assert code == 0 and "SIGTERM: checkpoint" in out

        code, out, err = cli("exec", "ct200", "--", "sh", "-c", "echo $$; hostname")
        assert code == 0 and int(out.split()[0]) < 1000  # ran inside the container's PID namespace

        # The decoy python3 (not ours) survived stop and restart; both run directories are there.
        assert harness.in_container("200", "kill", "-0", decoy, check=False).returncode == 0
        for name in ("rem-a1", child):
            assert harness.container_path("200", f"{workspace_of(inventory)}/runs/{name}/run.json").is_file()
    finally:
        harness.in_container("200", "kill", decoy, check=False)


def test_nohup_launcher_and_a_crash_are_reported(inventory: Path) -> None:
    code, out, err = cli(
        "deploy",
        "ct200",
        "--profile",
        "work",
        "--name",
        "rem-crash",
        "--launcher",
        "nohup",
        "--wait",
        "^never$",
        "--timeout",
        "60",
        "--",
        "--crash-at",
        "3",
    )
    assert code == 7, err  # RunFailed: the traceback pattern appeared while waiting
    assert "Traceback" in err or "crash" in err
    entry = json.loads(cli("status", "rem-crash", "--json")[1])["runs"][0]
    assert entry["state"] == "crashed" and entry["exit_code"] == 1


def test_stopped_and_missing_containers_launch_nothing(inventory: Path, harness: Harness) -> None:
    code, out, err = cli("deploy", "--detach", "ct201", "--profile", "work", "--name", "rem-s1")
    assert code == 5 and "error: container 201 on pve is stopped" in err and "hint: start it" in err
    code, out, err = cli("deploy", "--detach", "ct999", "--profile", "work", "--name", "rem-m1")
    assert code == 3 and "Configuration file 'nodes/" in err and "999.conf' does not exist" in err
    assert not (harness.pct_state / "201" / "workspace" / inventory.parent.name).exists()
    code, out, err = cli("runs", "list", "--json")
    assert "rem-s1" not in out and "rem-m1" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ("deploy", "--detach", "ct200", "--profile", "work", "--name", "x;reboot"),
        ("deploy", "--detach", "ct200", "--profile", "work", "--name", "a b"),
        ("deploy", "--detach", "ct200", "--profile", "work", "--name", "../../etc"),
        ("deploy", "--detach", "ct200", "--profile", "work", "--name", "it's"),
        ("deploy", "--detach", "ct200", "--profile", "work", "--name", "x" * 65),
        ("stop", "$(reboot)", "--target", "ct200"),
        ("logs", "a|b", "--target", "ct200"),
        ("status", "`id`", "--target", "ct200"),
    ],
)
def test_injection_in_names_is_refused_before_connecting(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    # The host points at a closed port: had anything tried to connect, the error would be "refused".
    path = write_inventory(tmp_path / "inventory.yaml", harness, port=free_port())
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    code, out, err = cli(*argv)
    assert code == 2, err
    assert err.startswith("error: invalid") and "connection refused" not in err


def test_unknown_host_key_through_the_cli(tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_inventory(tmp_path / "inventory.yaml", harness)
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    path.write_text(path.read_text().replace(str(harness.known_hosts), str(empty)))
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    code, out, err = cli("status", "--target", "ct200")
    assert code == 5
    assert "error: host key of [127.0.0.1]:" in err and "SHA256:" in err
    assert "hint: check the fingerprint out of band, then run: dflashops trust pve" in err
    assert "Traceback" not in err


def test_trust_records_the_key_then_commands_work(
    tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_inventory(tmp_path / "inventory.yaml", harness)
    known = tmp_path / "known_hosts_new"
    path.write_text(path.read_text().replace(str(harness.known_hosts), str(known)))
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # noqa: SIM115 - lives as long as the test
    code, out, err = cli("trust", "pve")
    assert code == 2 and "not recording without confirmation" in err and not known.exists()
    code, out, err = cli("trust", "pve", "--fingerprint", "SHA256:wrong")
    assert code == 4 and not known.exists()
    fp = out.split()[-1]
    code, out, err = cli("trust", "pve", "--fingerprint", fp)
    assert code == 0, err
    assert known.read_text().startswith(f"[127.0.0.1]:{harness.port} ssh-ed25519 ")
    assert oct(known.stat().st_mode & 0o777) == "0o600"
    assert cli("exec", "ct200", "--", "true")[0] == 0
    code, out, err = cli("trust", "ct200", "--yes")  # a target name means its host; already known
    assert code == 0 and "already known" in err and len(known.read_text().splitlines()) == 1


def test_trust_refuses_a_changed_key(tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_inventory(tmp_path / "inventory.yaml", harness)
    other = tmp_path / "other"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {other}")
    known = tmp_path / "known_hosts_old"
    key_type, key_b64 = (tmp_path / "other.pub").read_text().split()[:2]
    known.write_text(f"[127.0.0.1]:{harness.port} {key_type} {key_b64}\n")
    path.write_text(path.read_text().replace(str(harness.known_hosts), str(known)))
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    code, out, err = cli("trust", "pve", "--yes")
    assert code == 4 and "DIFFERENT" in err and "ssh-keygen -R" in err
    assert len(known.read_text().splitlines()) == 1


def test_host_and_direct_modes(tmp_path: Path, harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # `host`: a plain GPU server (this machine as the test user); `direct`: a container with its own sshd
    # (the same loopback sshd stands in for it). Both are ssh without pct.
    home_ws = f"/home/{harness.user}/dfo-{tmp_path.name}"
    extra = f"""\
        gpubox: {{kind: host, host: pve, workspace: {home_ws}}}
        ctdirect: {{kind: direct, host: pve, workspace: {home_ws}-direct}}
        """
    path = write_inventory(tmp_path / "inventory.yaml", harness, extra_targets=extra)
    monkeypatch.setenv("DFLASHOPS_INVENTORY", str(path))
    try:
        for target in ("gpubox", "ctdirect"):
            code, out, err = cli("exec", target, "--", "id", "-un")
            assert code == 0 and out.strip() == harness.user, err
        code, out, err = cli(
            "deploy", "gpubox", "--profile", "work", "--name", "host-r1", "--wait", r"^step 2 ", "--timeout", "60"
        )
        assert code == 0, err
        code, out, err = cli("stop", "host-r1", "--grace", "10")
        assert code == 0, err
    finally:
        cli("stop", "host-r1", "--grace", "1")
        os.system(f"rm -rf -- {home_ws} {home_ws}-direct")
