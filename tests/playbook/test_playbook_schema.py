"""Playbook validation: every refusal names the file and line, and nothing runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dflashops.playbook import PlaybookError, load_playbook, parse_set, render
from tests.controller.helpers import Env
from tests.playbook.conftest import PLAYBOOKS

Write = Callable[[str, str], Path]


def refused(path: Path, overrides: dict | None = None) -> str:
    with pytest.raises(PlaybookError) as info:
        load_playbook(path).bind(overrides or {})
    return info.value.message


def test_shipped_playbooks_validate() -> None:
    for name in ("restart-cycle.yaml", "sweep.yaml"):
        playbook = load_playbook(PLAYBOOKS / name)
        assert playbook.steps and playbook.description
    cycle = load_playbook(PLAYBOOKS / "restart-cycle.yaml")
    assert [s.kind for s in cycle.steps] == ["stop", "sync", "clear-cache", "deploy", "wait"]
    sweep = load_playbook(PLAYBOOKS / "sweep.yaml")
    assert [s.kind for s in sweep.steps[1].body] == ["deploy", "wait", "collect", "stop"]


def test_unknown_step_names_file_and_line(write: Write) -> None:
    path = write("p.yaml", "steps:\n  - stop: {run: a}\n  - name: typo\n    stpo: {run: a}\n")
    message = refused(path)
    assert message.startswith(f"{path}:4:") and "unknown step 'stpo'" in message


def test_wait_without_timeout(write: Write) -> None:
    path = write("p.yaml", "steps:\n  - wait:\n      run: a\n      metric: step >= 5\n")
    message = refused(path)
    assert f"{path}:3:" in message and "needs 'timeout'" in message
    path = write("q.yaml", "steps:\n  - wait: {run: a, log: x, timeout: 0}\n")
    assert "timeout must be a number of seconds > 0" in refused(path)


def test_missing_variable(write: Write) -> None:
    path = write("p.yaml", "vars:\n  run: null\nsteps:\n  - stop: {run: '{{run}}'}\n")
    assert refused(path).startswith(f"{path}:2: missing variable 'run'")
    assert load_playbook(path).bind({"run": "x"})["run"] == "x"
    undefined = write("u.yaml", "steps:\n  - stop: {run: a}\n  - stop: {run: '{{nope}}'}\n")
    message = refused(undefined)
    assert message.startswith(f"{undefined}:3:") and "{{nope}}" in message
    later = write(
        "l.yaml",
        "steps:\n  - wait: {run: '{{d.name}}', log: x, timeout: 1}\n  - deploy: {profile: work}\n    register: d\n",
    )
    assert "{{d}}" in refused(later)
    with pytest.raises(PlaybookError, match="no variable 'rnu'"):
        load_playbook(path).bind({"rnu": "x"})


def test_include_cycle(write: Write) -> None:
    write("a.yaml", "steps:\n  - stop: {run: x}\n  - include: {file: b.yaml}\n")
    write("b.yaml", "steps:\n  - include: {file: c.yaml}\n")
    c = write("c.yaml", "steps:\n  - include: {file: a.yaml}\n")
    message = refused(c.parent / "a.yaml")
    assert message.startswith(f"{c.resolve()}:2:") and "include cycle: a.yaml -> b.yaml -> c.yaml -> a.yaml" in message


def test_include_splices_steps_and_vars(write: Write) -> None:
    write("inner.yaml", "vars:\n  grace: 5\nsteps:\n  - stop: {run: '{{run}}', grace: '{{grace}}'}\n")
    outer = write(
        "outer.yaml", "vars:\n  run: r1\nsteps:\n  - include: {file: inner.yaml, vars: {grace: 7}}\n  - sync: {}\n"
    )
    playbook = load_playbook(outer)
    assert [s.kind for s in playbook.steps] == ["stop", "sync"]
    assert render(playbook.steps[0].args, playbook.bind({})) == {"run": "r1", "grace": 7}


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("steps:\n  - stop: {run: a, graec: 3}\n", 2, "unknown key 'graec'"),
        ("steps:\n  - stop: {run: a}\n    on_failure: retry\n", 2, "on_failure 'retry'"),
        ("steps:\n  - sync: {}\n    on_failure: restart-with-resume\n", 2, "needs a step that names a `run`"),
        ("steps:\n  - wait: {run: a, metric: 'step >> 3', timeout: 5}\n", 2, "unexpected '>'"),
        ("steps:\n  - wait: {run: a, log: '(', timeout: 5}\n", 2, "invalid regular expression"),
        ("steps:\n  - wait: {run: a, timeout: 5}\n", 2, "exactly one of"),
        ("steps:\n  - stop: {run: a}\n    sync: {}\n", 2, "exactly one kind"),
        ("steps:\n  - exec: {argv: 'rm -rf /'}\n", 2, "list of words"),
        ("steps:\n  - stop: {run: a\n", 3, "invalid YAML"),
        ("stesp: []\n", 1, "unknown key 'stesp'"),
    ],
)
def test_bad_playbooks(write: Write, text: str, line: int, words: str) -> None:
    path = write("p.yaml", text)
    message = refused(path)
    assert message.startswith(f"{path}:{line}:"), message
    assert words in message


def test_set_values_are_yaml() -> None:
    assert parse_set(["steps=10", "note=a b", "grid=[1, 2]", "empty="]) == {
        "steps": 10,
        "note": "a b",
        "grid": [1, 2],
        "empty": "",
    }
    with pytest.raises(Exception, match="expected key=value"):
        parse_set(["novalue"])


def test_render_keeps_types_and_nests() -> None:
    scope = {"run": "exp5", "note": "restart of {{run}}", "grid": [{"tag": "a", "args": ["--lr", "1"]}]}
    assert render("{{grid}}", scope) == scope["grid"]
    assert render(["x-{{grid[0].tag}}", "{{note}}"], scope) == ["x-a", "restart of exp5"]


def test_cli_refuses_bad_playbook_and_runs_nothing(env: Env, write: Write, capsys: pytest.CaptureFixture[str]) -> None:
    path = write("bad.yaml", "steps:\n  - deploy: {profile: work, name: never}\n  - wait: {run: never, log: x}\n")
    code, out, err = env.cli("play", str(path), capsys=capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {path}:3:") and "needs 'timeout'" in err
    assert not env.workspace.exists() and not env.db.exists()
    code, _, err = env.cli("play", str(PLAYBOOKS / "restart-cycle.yaml"), "--set", "bogus=1", capsys=capsys)
    assert code == 2 and "no variable 'bogus'" in err and "hint: variables:" in err
    for check in (["--check"], []):  # `run` defaults to the newest running run: there is none
        code, out, err = env.cli(
            "play", str(PLAYBOOKS / "restart-cycle.yaml"), "--target", "local", *check, capsys=capsys
        )
        assert code == 3 and out == "" and "error: no run is running on target local" in err
        assert "hint: name the run: --set run=NAME" in err
    assert not env.runs.exists() and not env.db.exists()
    code, _, err = env.cli("play", str(env.root / "missing.yaml"), capsys=capsys)
    assert code == 2 and "does not exist" in err
