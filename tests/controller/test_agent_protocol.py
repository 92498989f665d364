"""The agent's wire protocol (dflashops/agent/protocol.py): each verb's request is parsed once at the agent's
entry, and a key the verb does not know, a required key that is missing, or a value of the wrong JSON type is
ONE `bad_request` answer naming the verb and the key, before the verb runs. The controller builds its requests
from the same dataclasses and checks the dicts it still sends against them; it refuses an agent that speaks
another protocol version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflashops.agent.protocol import PROTOCOL_VERSION, REQUESTS, InstallRequest, RestartRequest, parse, wire
from dflashops.core.errors import AgentError, UsageError
from dflashops.core.inventory import Target
from dflashops.ops.agent_client import Agent
from dflashops.transport.local import LocalTransport
from tests.controller.helpers import AGENT


def agent_call(verb: str, request: dict, *, stdin_line: bool = False) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of one call of the real agent process."""
    if stdin_line:
        argv, data = [sys.executable, str(AGENT), verb], json.dumps(request).encode() + b"\n"
    else:
        argv, data = [sys.executable, str(AGENT), verb, "--json-args", json.dumps(request)], b""
    out = subprocess.run(argv, input=data, capture_output=True, timeout=60)
    return out.returncode, out.stdout.decode().splitlines(), out.stderr.decode()


def test_an_unknown_key_is_one_bad_request_naming_the_verb_and_the_key(tmp_path: Path) -> None:
    (tmp_path / "ws" / "runs" / "r1").mkdir(parents=True)
    code, lines, err = agent_call("status", {"workspace": str(tmp_path / "ws"), "name": "r1", "nmae": "r1"})
    assert code == 2 and len(lines) == 1, err
    answer = json.loads(lines[0])
    assert answer["ok"] is False and answer["code"] == "bad_request"
    assert answer["error"].startswith("status: unknown key 'nmae'") and "name" in answer["error"]


def test_a_missing_key_is_one_bad_request_naming_the_verb_and_the_key(tmp_path: Path) -> None:
    (tmp_path / "ws" / "runs" / "r1").mkdir(parents=True)
    code, lines, err = agent_call("stop", {"workspace": str(tmp_path / "ws")})
    assert code == 2 and len(lines) == 1, err
    answer = json.loads(lines[0])
    assert answer == {"ok": False, "error": "stop: missing key 'name'", "code": "bad_request"}


def test_a_value_of_the_wrong_type_and_a_nested_key_are_named_too(tmp_path: Path) -> None:
    workspace = str(tmp_path / "ws")
    code, lines, _ = agent_call("tail", {"workspace": workspace, "name": "r1", "offset": "12"})
    assert code == 2 and json.loads(lines[0])["error"] == "tail: key 'offset' must be int or None, not str"
    request = {"workspace": workspace, "old": "a", "name": "b", "argv": ["true"], "install": {"hsh": "0"}}
    code, lines, _ = agent_call("restart", request, stdin_line=True)  # refused before its tar is read
    answer = json.loads(lines[0])
    assert code == 2 and answer["code"] == "bad_request"
    assert answer["error"].startswith("restart: unknown key 'install.hsh'")
    assert not (tmp_path / "ws").exists()  # nothing was made


def test_a_raw_verb_refuses_a_bad_request_on_stderr_with_exit_status_3(tmp_path: Path) -> None:
    (tmp_path / "ws" / "runs" / "r1").mkdir(parents=True)
    code, lines, err = agent_call("read-file", {"workspace": str(tmp_path / "ws"), "name": "r1", "pth": "f"})
    assert code == 3 and lines == []  # stdout carries only a file's bytes
    answer = json.loads(err.splitlines()[-1])
    assert answer["code"] == "bad_request" and answer["error"].startswith("read-file: unknown key 'pth'")


def test_optional_keys_keep_their_defaults_and_a_request_survives_its_wire_form() -> None:
    assert parse("stop", {"workspace": "/w", "name": "r"}).grace == 60.0
    assert parse("stop", {"workspace": "/w", "name": "r"}).kill_s() == 10.0
    request = RestartRequest(
        workspace="/w", name="b", old="a", argv=["python3", "-m", "trainer"], install=InstallRequest(workspace="/w")
    )
    assert wire(parse("restart", json.loads(json.dumps(wire(request))))) == wire(request)
    assert "now" not in wire(parse("stop", {"workspace": "/w", "name": "r"}))  # an empty default is not sent
    assert set(REQUESTS) >= {"ping", "launch", "stop", "status", "restart", "install", "tail", "follow"}


def test_the_controller_checks_a_request_before_any_call(tmp_path: Path) -> None:
    target = Target(name="local", kind="local", workspace=str(tmp_path / "ws"), python=sys.executable)
    agent = Agent(target, LocalTransport())
    with pytest.raises(UsageError, match="agent request: gc: unknown key 'keeep'"):
        agent.call("gc", {"workspace": target.workspace, "keeep": 3})
    assert not (tmp_path / "ws").exists()  # no call was made: not even the agent's upload


def test_the_controller_refuses_an_agent_of_another_protocol_version(tmp_path: Path) -> None:
    target = Target(name="local", kind="local", workspace=str(tmp_path / "ws"), python=sys.executable)
    agent = Agent(target, LocalTransport())
    Path(agent.path).parent.mkdir(parents=True)
    other = {"ok": True, "version": PROTOCOL_VERSION + 1, "python": "3"}
    Path(agent.path).write_text(f"print({json.dumps(json.dumps(other))})\n")  # an agent file of another version
    with pytest.raises(AgentError) as refused:
        agent.ensure()
    assert f"speaks protocol {PROTOCOL_VERSION + 1}, this controller speaks protocol {PROTOCOL_VERSION}" in str(
        refused.value.message
    )
