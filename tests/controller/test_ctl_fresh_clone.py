"""Issue 29 ("daily use, round two: what a new user tripped over in a fresh clone"): every item is checked by
running the command as a user types it (real processes, real tmux, real SQLite, the local target)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env
from tests.controller.test_ctl_friction import dflashops  # a real process in `cwd`, no inventory named


# ------------------------------------------------------------------ item 4: trainer arguments without `--`
@pytest.mark.parametrize(
    ("words", "unrecognized", "fixed"),
    [
        (
            ["deploy", "--profile", "tiny", "--max-steps", "10"],
            "--max-steps 10",
            "dflashops deploy --profile tiny -- --max-steps 10",
        ),
        (["restart", "R", "--lr", "1e-3"], "--lr 1e-3", "dflashops restart R -- --lr 1e-3"),
    ],
)
def test_item4_trainer_arguments_without_the_separator_get_the_fixed_command(
    env: Env, words: list[str], unrecognized: str, fixed: str
) -> None:
    out = env.run_cli(*words)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith(f"usage: dflashops {words[0]} "), out.stderr  # the verb's usage, not the top level
    assert lines[-2:] == [
        f"error: unrecognized arguments: {unrecognized}",
        f"hint: trainer arguments go after `--`: {fixed}",
    ]
    assert not any(env.runs.glob("*")), "nothing was launched"


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------- item 1: every lineage view shows the state of now
def test_item1_show_export_and_tree_show_the_state_the_run_directory_holds_now(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that finished at step 20 after its deploy returned (no `status` call since): the record still
    says `launched`, but every view reads the run directory, as `runs list` does."""
    code, _, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "fin-1", "--launcher", "nohup", "--", "--steps", "20", "--interval", "0",
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    wait_until(lambda: (env.runs / "fin-1" / "exit_code").is_file())
    current = {"state": "finished", "exit_code": 0, "last_step": 20, "state_from": "run directory"}
    code, out, _ = env.cli("runs", "show", "fin-1", "--json", capsys=capsys)
    assert code == 0 and {k: json.loads(out)[k] for k in current} == current, out
    code, out, _ = env.cli("runs", "export", "--json", capsys=capsys)
    assert code == 0 and {k: json.loads(out)[0][k] for k in current} == current, out
    code, out, _ = env.cli("runs", "export", capsys=capsys)  # CSV
    row = next(csv.DictReader(io.StringIO(out)))
    assert (row["state"], row["exit_code"], row["last_step"], row["state_from"]) == (
        "finished",
        "0",
        "20",
        "run directory",
    )
    code, out, _ = env.cli("runs", "tree", "--json", capsys=capsys)
    node = json.loads(out)[0]
    assert (node["state"], node["exit_code"], node["last_step"], node["state_as_of"]) == ("finished", 0, 20, None)
    code, out, _ = env.cli("runs", "show", "fin-1", capsys=capsys)
    assert re.search(r"^state\s+finished\s*$", out, re.M) and re.search(r"^last_step\s+20\s*$", out, re.M), out


def test_item1_a_run_whose_directory_is_elsewhere_says_when_its_state_was_recorded(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    assert env.deploy_one_step("far-1", capsys) == 0
    shutil.move(env.runs / "far-1", env.root / "moved")  # as if on a target this machine cannot read
    code, out, err = env.cli("runs", "show", "far-1", capsys=capsys)
    assert code == 0 and "note: far-1's state is as recorded at 20" in err and "`dflashops status far-1`" in err
    assert re.search(r"^state_from\s+lineage record \(its run directory on local is not on this machine\)", out, re.M)
    code, out, _ = env.cli("runs", "tree", capsys=capsys)
    assert code == 0 and "(state as recorded 20" in out, out


# ----------------------------------------------------------- item 2: Ctrl-C during a follow, on the local target
def interrupted(env: Env, *words: str, ready: Callable[[str], bool]) -> tuple[int, str, str]:
    """dflashops as a real process in a process group of its own (as a shell runs it); once `ready(stderr and
    stdout so far)`, SIGINT to that group as a terminal's Ctrl-C sends it. (exit code, stdout, stderr)."""
    out_path, err_path = env.root / "ctrl-c.out", env.root / "ctrl-c.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), *words],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=env.root,
            start_new_session=True,
            # As a terminal's shell starts a job: Ctrl-C's default. A background `make test` (nohup, `&`) starts
            # its children with SIGINT ignored, and Python then never raises KeyboardInterrupt.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            wait_until(lambda: ready(out_path.read_text() + err_path.read_text()))
            time.sleep(0.3)  # inside the follow stream, not between two answers
            os.killpg(proc.pid, signal.SIGINT)  # the group we started: the CLI and its local agent
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return code, out_path.read_text(), err_path.read_text()


def test_item2_ctrl_c_during_logs_follow_says_the_run_goes_on_and_how_to_follow_again(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "cc-1", "--launcher", "nohup", "--wait", "step 2", "--",
        "--interval", "0.05", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = interrupted(env, "logs", "cc-1", "-f", ready=lambda text: "step 5 " in text)
    assert code == 130 and "step 5 " in out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    found = re.fullmatch(r"cc-1 is still running; follow again: dflashops logs cc-1 -f --since (\d+)\n", err)
    assert found, err
    offset = int(found.group(1))
    log = (env.runs / "cc-1" / "train.log").read_bytes()
    assert offset > 0 and log[offset - 1 : offset] == b"\n"  # a line start
    assert log[:offset].decode() in out  # everything before it was shown
    code, again, _ = env.cli("logs", "cc-1", "--since", str(offset), capsys=capsys)
    later = (env.runs / "cc-1" / "train.log").read_bytes()  # read after `again`: the run trains on meanwhile
    assert code == 0 and later[offset:].decode().startswith(again)  # it goes on from there
    code, status, _ = env.cli("status", "cc-1", capsys=capsys)
    assert re.search(r"^cc-1\s+local\s+running\s", status, re.M)  # the follow ended, the run did not


def test_item2_ctrl_c_during_deploy_wait_says_the_run_goes_on(env: Env) -> None:
    code, out, err = interrupted(
        env, "deploy", "--profile", "work", "--name", "cc-2", "--launcher", "nohup", "--wait", "never matches",
        ready=lambda text: "step 5 " in text,
    )  # fmt: skip
    assert code == 130 and out == "cc-2\n", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert re.search(r"^cc-2 is still running; follow again: dflashops logs cc-2 -f --since \d+$", err, re.M), err
    assert err.endswith("\n") and err.splitlines()[-1].startswith("cc-2 is still running")


# ------------------------------------------------------------------ item 6: logs -n N, --since on a line start
def test_item6_logs_tail_n_and_since_on_a_line_start(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "tl-1", "--launcher", "nohup", "--wait", "done", "--",
        "--steps", "12", "--interval", "0", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    log = (env.runs / "tl-1" / "train.log").read_text()
    lines = log.splitlines(keepends=True)
    code, out, _ = env.cli("logs", "tl-1", "-n", "3", capsys=capsys)
    assert code == 0 and out == "".join(lines[-3:])
    code, out, _ = env.cli("logs", "tl-1", "--tail", "3", "-f", capsys=capsys)  # the run has ended: -f returns
    assert code == 0 and out == "".join(lines[-3:])
    assert env.cli("logs", "tl-1", "-n", "0", capsys=capsys)[1] == ""
    assert env.cli("logs", "tl-1", "-n", "1000", capsys=capsys)[1] == log
    middle = len(lines[0]) + 3  # inside the second line
    code, out, _ = env.cli("logs", "tl-1", "--since", str(middle), capsys=capsys)
    assert code == 0 and out == "".join(lines[2:])  # from the next line start, never half a line
    start = len(lines[0]) + len(lines[1])  # a line start stays where it is
    assert env.cli("logs", "tl-1", "--since", str(start), capsys=capsys)[1] == "".join(lines[2:])
    code, _, err = env.cli("logs", "tl-1", "-n", "3", "--since", "5", capsys=capsys)
    assert code == 2 and err.startswith("error: ") and "hint: " in err


# -------------------------------------------------------------------- item 8: gc says what it deletes, and did
def test_item8_gc_dry_run_lists_paths_and_sizes_and_a_collected_run_says_so(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    assert env.deploy_one_step("gc-1", capsys) == 0
    directory = env.runs / "gc-1"
    wait_until(lambda: (directory / "exit_code").is_file())
    code, out, err = env.cli("gc", "--run", "gc-1", "--dry-run", capsys=capsys)
    assert code == 0 and directory.is_dir(), err  # nothing deleted
    line = next(line for line in out.splitlines() if line.startswith("would remove run gc-1"))
    assert f"  {directory}  " in line and re.search(r"  [\d.]+ (B|KiB|MiB) in \d+ files$", line), out
    assert err.rstrip().endswith("would be deleted; nothing was deleted") and "{" not in out  # a summary, not JSON
    bytes_now = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
    code, out, err = env.cli("gc", "--run", "gc-1", "--dry-run", "--json", capsys=capsys)
    item = json.loads(out)["removed"][0]
    assert (item["path"], item["bytes"], json.loads(out)["dry_run"]) == (str(directory), bytes_now, True)
    assert directory.is_dir()

    code, out, err = env.cli("gc", "--run", "gc-1", capsys=capsys)
    assert code == 0 and not directory.exists(), err
    assert out.startswith(f"removed run gc-1  {directory}  ") and "gc on local: deleted 1 run directory" in err

    code, out, err = env.cli("logs", "gc-1", capsys=capsys)
    assert code == 3 and out == "", err
    assert re.search(
        r"^error: local: run 'gc-1' was collected: its run directory was deleted by `dflashops gc` at 20", err
    )
    assert err.splitlines()[-1] == "hint: its lineage record stays: dflashops runs show gc-1"
    assert "never started" not in err
    code, out, _ = env.cli("runs", "tree", capsys=capsys)
    assert code == 0 and "gc-1  [finished]" in out and "[collected: run directory deleted by gc at 20" in out, out
    code, out, _ = env.cli("runs", "show", "gc-1", "--json", capsys=capsys)
    shown = json.loads(out)
    assert shown["extra"]["collected"]["by"] == "gc" and shown["state_from"].endswith("deleted by gc)")

    code, out, _ = env.cli("gc", "--json", capsys=capsys)  # --json: the JSON it printed before
    assert code == 0 and json.loads(out)["removed_runs"] == []


# ------------------------------------------------------ item 3: `dflashops` after `make demo`, venv not active
def test_item3_the_command_the_demo_prints_runs_dflashops_without_an_active_venv() -> None:
    """The demo's "next:" line names `dflashops` the way it runs from the repository with the Makefile's
    .venv not activated (PATH without it, as after `make demo`), and the `source` line it adds works too."""
    script = Path(sys.executable).parent / "dflashops"
    if not script.is_file():
        pytest.skip("dflashops is not installed beside this Python (not the Makefile's .venv)")
    bare = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    bare.pop("VIRTUAL_ENV", None)
    show = "from dflashops.cli.demo import dflashops_command as c; print(*c(), sep='\\n')"
    out = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, env=bare, cwd=REPO, check=True)
    command, activate = out.stdout.splitlines()
    assert command != "dflashops" and activate.endswith("bin/activate"), out.stdout
    for line in (f"{command} --version", f"source {activate} && dflashops --version"):
        typed = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=bare, cwd=REPO)
        assert typed.returncode == 0 and typed.stdout.startswith("dflashops "), (line, typed.stderr)
    typed = subprocess.run(["bash", "-c", "dflashops --version"], capture_output=True, text=True, env=bare, cwd=REPO)
    assert typed.returncode == 127  # what the issue saw: not on PATH until then


# ------------------------------------------------------------------------------ item 9: the small ones
def test_item9_runs_list_with_no_match_says_which_filter_matched_nothing(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = env.cli("runs", "list", "--state", "running", capsys=capsys)
    assert code == 0 and err.startswith("no runs recorded")  # nothing recorded at all
    assert env.deploy_one_step("ls-1", capsys) == 0
    wait_until(lambda: (env.runs / "ls-1" / "exit_code").is_file())
    code, out, err = env.cli("runs", "list", "--state", "running", capsys=capsys)
    assert code == 0 and out == "" and err == "no runs match --state running\n"
    code, out, err = env.cli("runs", "list", "--state", "finished", "--target", "local", capsys=capsys)
    assert code == 0 and "ls-1" in out  # the state the table shows, read from the run directory


def test_item9_fetched_folder_is_ignored_by_git() -> None:
    assert "fetched/" in (REPO / ".gitignore").read_text().splitlines()


def test_item9_a_command_run_from_another_folder_says_which_inventory_it_uses(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = dflashops("runs", "list", cwd=elsewhere)
    assert out.returncode == 0
    assert out.stderr.splitlines()[0] == (
        f"using inventory {REPO / 'inventory.yaml'} (there is no inventory.yaml in {elsewhere}; "
        "--inventory PATH names another)"
    )
    (elsewhere / "inventory.yaml").write_text("targets:\n  local: {kind: local, workspace: ws}\n")
    out = dflashops("runs", "list", cwd=elsewhere)
    assert out.returncode == 0 and "using inventory" not in out.stderr  # the current folder's: nothing to say
    out = dflashops("--inventory", str(REPO / "inventory.yaml"), "runs", "list", cwd=tmp_path)
    assert "using inventory" not in out.stderr  # named: nothing to say


def test_item9_runs_plot_and_list_options_have_help() -> None:
    for verb, options in (("plot", ("--out", "--title", "--log-y")), ("list", ("--state", "--target"))):
        out = dflashops("runs", verb, "--help", cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        for option in options:
            entry = re.search(rf"^  {option}\b.*?(?=^  \S|\Z)", out.stdout, re.M | re.S)
            assert entry and len(entry.group(0).split()) > 3, (option, out.stdout)  # more than the invocation


# -------------------------------------------------------------------- item 10: the CPU build of torch, named
def test_item10_make_setup_installs_the_cpu_build_of_torch_and_no_cuda() -> None:
    plan = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert plan.returncode == 0, plan.stderr
    installs = [line for line in plan.stdout.splitlines() if "pip install" in line and "torch==" in line]
    assert installs and all(re.search(r'"torch==[\d.]+\+cpu"', line) for line in installs), installs
    assert any("--extra-index-url https://download.pytorch.org/whl/cpu" in line for line in installs)
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        return  # not the Makefile's environment: what it installed is someone else's business
    from importlib.metadata import distributions, version

    assert version("torch").endswith("+cpu")
    assert not [d.metadata["Name"] for d in distributions() if d.metadata["Name"].lower().startswith("nvidia-")]
