"""New-user friction (issue 15, items 19, 21, 22): every verb explains itself in `--help`, `--version` exists,
the shipped inventory's defaults work on a fresh checkout, and a mistyped run name or a misplaced command
gets a `hint:`. Everything runs the real CLI (in-process or as a real process) against real files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env

DOCUMENTED_VERBS = ("stop", "status", "logs", "exec", "attach", "gc", "deploy", "restart")


def dflashops(
    *args: str, cwd: Path = REPO, extra_env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(extra_env or {})}
    env.pop("DFLASHOPS_INVENTORY", None)
    return subprocess.run(
        [sys.executable, "-m", "dflashops.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def help_sections(text: str) -> tuple[str, dict[str, list[str]]]:
    """argparse help -> (the description between the usage and the first section, {section: its lines})."""
    head, _, rest = text.partition("\n\n")
    assert head.startswith("usage: "), text
    description, sections, current = [], {}, None
    for line in rest.splitlines():
        if re.match(r"^[a-z ]+:$", line):  # "positional arguments:", "options:"
            current = sections.setdefault(line[:-1], [])
        elif current is None:
            description.append(line)
        else:
            current.append(line)
    return "\n".join(description).strip(), sections


def undocumented(lines: list[str]) -> list[str]:
    """Argument lines with no help text: an invocation (two-space indent) with nothing after it on its line
    and no deeper-indented help line below it."""
    missing = []
    for index, line in enumerate(lines):
        if not re.match(r"^  \S", line):
            continue
        has_text_after = re.match(r"^  \S.*?\s{2,}\S", line) is not None
        next_line = lines[index + 1] if index + 1 < len(lines) else ""
        if not has_text_after and not re.match(r"^ {4,}\S", next_line):
            missing.append(line.strip())
    return missing


def test_item19_every_verb_has_a_description_and_help_on_every_argument() -> None:
    problems = []
    for verb in DOCUMENTED_VERBS:
        out = dflashops(verb, "--help", extra_env={"COLUMNS": "100"})
        assert out.returncode == 0, out.stderr
        description, sections = help_sections(out.stdout)
        if len(description) < 20:
            problems.append(f"`dflashops {verb} --help` has no description")
        lines = [line for body in sections.values() for line in body]
        if not lines or undocumented(lines):
            problems.append(f"`dflashops {verb} --help`: arguments without help: {undocumented(lines)}")
    assert problems == []


@pytest.mark.parametrize("verb", ("deploy", "restart"))
def test_item19_deploy_and_restart_usage_shows_trainer_args(verb: str) -> None:
    out = dflashops(verb, "--help", extra_env={"COLUMNS": "200"})
    usage = out.stdout.partition("\n\n")[0]
    assert out.returncode == 0 and usage.rstrip().endswith("[-- trainer args]"), out.stdout


def test_item19_exec_usage_shows_the_command_after_the_separator() -> None:
    out = dflashops("exec", "--help", extra_env={"COLUMNS": "200"})
    assert out.returncode == 0 and "-- COMMAND" in out.stdout.partition("\n\n")[0], out.stdout


def pyproject_version() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def test_item19_version_prints_the_package_version() -> None:
    out = dflashops("--version")
    assert out.returncode == 0 and out.stdout == f"dflashops {pyproject_version()}\n", (out.stdout, out.stderr)
    assert out.stderr == ""


def test_item19_version_falls_back_to_pyproject_when_not_installed() -> None:
    from dflashops.cli.main import package_version

    # A distribution name that is really not installed: importlib.metadata raises, pyproject answers.
    assert package_version("dflashops-not-installed-anywhere") == pyproject_version()


# A real network guard for the processes of item 21's test: connecting to anything but loopback is refused
# (and logged), so a shipped example target can never reach the network from a test.
NETWORK_GUARD = """
import ipaddress, os, socket

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex


def _check(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            loopback = ipaddress.ip_address(str(address[0]).split("%")[0]).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            with open(os.environ["DFO_GUARD_LOG"], "a") as log:
                log.write(f"{address[0]}\\n")
            raise OSError(f"test network guard: connection to {address[0]} refused")


def connect(self, address):
    _check(self, address)
    return _connect(self, address)


def connect_ex(self, address):
    _check(self, address)
    return _connect_ex(self, address)


socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
"""


def test_item21_all_verbs_work_with_the_shipped_inventory_on_a_fresh_checkout(tmp_path: Path) -> None:
    from dflashops.core.inventory import load_inventory
    from dflashops.ops.fleet.fanout import remote_targets

    checkout = tmp_path / "checkout"  # a fresh checkout after `make`: the shipped inventory and a .venv
    checkout.mkdir()
    (checkout / "inventory.yaml").write_bytes((REPO / "inventory.yaml").read_bytes())
    (checkout / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    inventory = load_inventory(checkout / "inventory.yaml")
    visited = [(t.name, t.kind) for t in remote_targets(inventory)]
    assert visited and all(kind == "local" for _, kind in visited), f"--all would reach out to: {visited}"

    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NETWORK_GUARD)
    log = tmp_path / "connections.log"
    env = {"PYTHONPATH": f"{guard}{os.pathsep}{REPO}", "DFO_GUARD_LOG": str(log), "NO_COLOR": "1"}
    status = dflashops("status", "--all", cwd=checkout, extra_env=env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "local" in status.stdout and "no runs" in status.stdout and "error" not in status.stdout
    ran = dflashops("exec", "--all", "--", "echo", "hi", cwd=checkout, extra_env=env)
    assert ran.returncode == 0 and ran.stdout == "[local] hi\n", ran.stdout + ran.stderr
    assert not log.exists(), log.read_text()


def test_item21_the_proxmox_example_lives_beside_the_inventory() -> None:
    from dflashops.core.inventory import load_inventory

    example = load_inventory(REPO / "inventory.example.yaml")
    assert example.targets["ct200"].kind == "pct" and example.targets["ct200"].host.name == "pve1"
    shipped = load_inventory(REPO / "inventory.yaml")
    assert "ct200" not in shipped.targets and "pve1" not in shipped.hosts
    assert "inventory.example.yaml" in (REPO / "README.md").read_text()
    assert "inventory.example.yaml" in (REPO / "inventory.yaml").read_text()


def test_item22_missing_run_names_get_close_names_as_a_hint(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    from dflashops.lineage import LineageDB, RunRecord

    # `alpha-7` exists only on the target (its lineage record is gone); `gamma-3` only in the lineage.
    assert env.deploy_one_step("alpha-7", capsys) == 0
    env.db.unlink()
    db = LineageDB(env.db)
    for name in ("gamma-3", "t1"):
        db.record(
            RunRecord(
                name=name,
                parent=None,
                note="",
                code_hash="ab" * 20,
                argv=["x"],
                env={},
                target="local",
                gpus=[],
                profile="work",
            )
        )
    db.close()
    for verb in ("status", "logs", "stop", "attach"):
        code, out, err = env.cli(verb, "alpha-8", capsys=capsys)
        assert code == 3 and out == "", (verb, err)
        assert err.startswith("error: ") and "alpha-8" in err and "hint: did you mean: alpha-7?" in err, (verb, err)
    code, _, err = env.cli("logs", "gama-3", capsys=capsys)
    assert code == 3 and "hint: did you mean: gamma-3?" in err, err
    code, _, err = env.cli("status", "zzzzzz", capsys=capsys)  # nothing close: still a hint, no guess
    assert code == 3 and "\nhint: " in err and "did you mean" not in err, err
    # `w1` is not a typo of `t1` (issue 46 item 8): a short name whose stem differs is another series.
    code, _, err = env.cli("status", "w1", capsys=capsys)
    assert code == 3 and "\nhint: " in err and "did you mean" not in err, err
    code, _, err = env.cli("status", "t2", capsys=capsys)  # the same series, another number: offered
    assert code == 3 and "hint: did you mean: t1?" in err, err


def test_item22_attach_refuses_without_a_terminal(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.cli("deploy", "--profile", "work", "--name", "tty-1", "--wait", "step 1", capsys=capsys)[0] == 0
    out = env.run_cli("attach", "tty-1")  # stdin and stdout are pipes, as in a script
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.startswith("error: attach needs a terminal"), out.stderr
    assert "hint: `dflashops logs tty-1 -f`" in out.stderr
    code, status, _ = env.cli("status", "tty-1", capsys=capsys)
    assert code == 0 and re.search(
        r"^tty-1\s+local\s+running\s", status, re.M
    )  # refused before anything touched the run


def test_item22_exec_command_without_the_separator_gets_a_hint(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = env.cli("exec", "local", "echo", "hi", capsys=capsys)
    assert code == 2 and out == "", err
    assert err.startswith("error: ")
    assert err.splitlines()[-1] == "hint: put the command after --: dflashops exec local -- echo hi"
    code, out, err = env.cli("exec", "--all", "echo", "hi", capsys=capsys)
    assert code == 2 and err.splitlines()[-1] == "hint: put the command after --: dflashops exec --all -- echo hi", err
    code, out, err = env.cli("exec", "local", "--", "echo", "hi", capsys=capsys)  # the right way still works
    assert code == 0 and out == "hi\n", err


def test_attach_to_a_local_run_whose_session_is_gone_says_so(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """The local tmux server is asked (libtmux) before tmux is exec'd: a run that ended has no session, and
    the answer is one line with a hint instead of tmux's own "can't find session"."""
    assert env.cli("deploy", "--profile", "work", "--name", "gone-1", "--wait", "step 1", capsys=capsys)[0] == 0
    assert env.cli("stop", "gone-1", "--grace", "5", capsys=capsys)[0] == 0
    code, _, err = env.cli("attach", "gone-1", capsys=capsys)
    assert code == 3 and "run 'gone-1' has no tmux session any more (stopped)" in err
    assert "hint: `dflashops logs gone-1`" in err
