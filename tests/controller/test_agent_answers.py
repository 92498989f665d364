"""The agent's answers (dflashops/agent/answers.py): each converted verb answers with its dataclass, printed as the
same JSON it always was, and the controller parses that JSON into the same dataclass. An unknown key, a missing
key or a value of the wrong type is ONE AgentError naming the target, the verb and the key; an agent of another
protocol version is still refused by its version, whatever the shape of its `ping` answer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflashops.agent.answers import ANSWERS, GpusAnswer, PingAnswer, answer_json, parse_answer
from dflashops.agent.protocol import PROTOCOL_VERSION, GpusRequest
from dflashops.core.errors import AgentError
from dflashops.core.inventory import Target
from dflashops.ops.agent_client import Agent
from dflashops.transport.local import LocalTransport


def fake_agent(tmp_path: Path, answer: dict) -> Agent:
    """An Agent whose file on the target prints `answer` for every verb (ping included)."""
    target = Target(name="local", kind="local", workspace=str(tmp_path / "ws"), python=sys.executable)
    agent = Agent(target, LocalTransport())
    Path(agent.path).parent.mkdir(parents=True)
    Path(agent.path).write_text(f"print({json.dumps(json.dumps(answer))})\n")
    return agent


def real_agent(tmp_path: Path) -> Agent:
    target = Target(name="local", kind="local", workspace=str(tmp_path / "ws"), python=sys.executable)
    return Agent(target, LocalTransport())


def test_a_real_answer_parses_into_its_dataclass_and_prints_back_the_same_json(tmp_path: Path) -> None:
    agent = real_agent(tmp_path)
    raw = agent.call("gpus", GpusRequest())
    gpus = parse_answer("gpus", GpusAnswer, raw)
    assert isinstance(gpus, GpusAnswer) and isinstance(gpus.available, bool)
    assert json.dumps({"ok": True, **answer_json(gpus)}) == json.dumps(raw)
    answer = agent.ask("gpus", GpusRequest(), GpusAnswer)
    assert answer is not None and all(gpu.memory_total_mib > 0 for gpu in answer.gpus)
    agent.ensure()  # its `ping` answer is checked too


def test_each_converted_verb_answers_the_json_its_dataclass_prints_back(tmp_path: Path) -> None:
    agent = real_agent(tmp_path)
    workspace = agent.target.workspace
    run = Path(workspace) / "runs" / "r1"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "weights").write_bytes(b"w" * 10)
    (run / "exit_code").write_text("0\n")
    (Path(workspace) / "cache" / "compile" / "py3.12-torch2.5").mkdir(parents=True)
    (run / "events.jsonl").write_text(json.dumps({"id": 1, "kind": "crashed"}) + "\n")  # a supervised run's keys
    (run / "restarted_as").write_text("r2\n")
    (run / "train.log").write_text("step 1\nstep 2\npartial")
    requests = [
        ("status", {"workspace": workspace}),
        ("status", {"workspace": workspace, "ended_within_s": 3600.0}),
        ("status", {"workspace": workspace, "name": "r1"}),
        ("tail", {"workspace": workspace, "name": "r1"}),
        ("tail", {"workspace": workspace, "name": "r1", "offset": 7, "inode": 1}),  # another inode: a notice
        ("manifest", {"workspace": workspace}),
        ("manifest", {"workspace": workspace, "release": "0" * 16}),
        ("fetch-manifest", {"workspace": workspace, "name": "r1", "paths": ["checkpoints", "nothing"]}),
        ("fetch-manifest", {"workspace": workspace, "name": "r1", "paths": ["checkpoints"], "hash": False}),
        ("preflight", {"workspace": workspace, "name": "r2", "argv": ["true"], "release": "0" * 16}),  # skipped
        ("gc", {"workspace": workspace, "runs": ["r1"], "dry_run": True}),
        ("clear-cache", {"workspace": workspace}),
    ]
    for verb, request in requests:
        raw = agent.call(verb, request)
        parsed = parse_answer(verb, ANSWERS[verb], raw)
        assert json.dumps({"ok": True, **answer_json(parsed)}) == json.dumps(raw), verb
        if verb == "status":
            assert parsed.runs[0].restarted_as == "r2" and parsed.runs[0].events == [{"id": 1, "kind": "crashed"}]
    assert raw["removed"] and not (Path(workspace) / "cache" / "compile" / "py3.12-torch2.5").exists()
    streamed = list(agent.stream("follow", {"workspace": workspace, "name": "r1"}))  # ended: its log, then the end
    assert streamed[0]["data"] == "step 1\nstep 2\npartial" and streamed[-1]["finished"]
    for line in streamed:
        assert answer_json(parse_answer("follow", ANSWERS["follow"], line)) == {
            k: v for k, v in line.items() if k != "ok"
        }


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"ok": True, "available": True, "gpus": [], "cpus": 3}, "gpus answer: unknown key 'cpus'"),
        ({"ok": True, "gpus": []}, "gpus answer: missing key 'available'"),
        ({"ok": True, "available": "yes", "gpus": []}, "gpus answer: key 'available' must be bool, not str"),
        (
            {"ok": True, "available": True, "gpus": [{"index": 0, "name": "H100", "memory_used_mib": 1}]},
            "gpus answer: missing key 'gpus[0].memory_total_mib'",
        ),
        ({"ok": True, "available": True, "gpus": ["H100"]}, "gpus answer: 'gpus[0]' must be dict, not str"),
    ],
)
def test_an_answer_that_does_not_fit_is_one_error_naming_the_verb_and_the_key(
    tmp_path: Path, answer: dict, message: str
) -> None:
    agent = fake_agent(tmp_path, answer)
    agent._ready = True  # the fake answers `ping` with the same line: not asked here
    with pytest.raises(AgentError) as refused:
        agent.ask("gpus", GpusRequest(), GpusAnswer)
    assert refused.value.message == f"local: the agent's answer does not fit this controller: {message}"


def test_another_protocol_version_is_refused_by_its_version_whatever_its_ping_answer_holds(tmp_path: Path) -> None:
    other = {"ok": True, "version": PROTOCOL_VERSION + 1, "python": "3", "answers": "new"}
    with pytest.raises(AgentError) as refused:
        fake_agent(tmp_path, other).ensure()
    assert f"speaks protocol {PROTOCOL_VERSION + 1}, this controller speaks protocol {PROTOCOL_VERSION}" in str(
        refused.value.message
    )


def test_an_optional_key_is_left_out_when_none_and_every_answer_survives_its_json() -> None:
    ping = PingAnswer(version=PROTOCOL_VERSION, python="3.12.1")
    assert answer_json(ping) == {"version": PROTOCOL_VERSION, "python": "3.12.1"}
    assert answer_json(parse_answer("ping", PingAnswer, {"ok": True, **answer_json(ping)})) == answer_json(ping)
    assert set(ANSWERS) >= {"ping", "gpus", "manifest", "install", "clear-cache", "gc", "fetch-manifest", "preflight"}
