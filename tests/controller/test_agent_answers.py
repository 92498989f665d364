"""The agent's answers (dflashops/agent/answers.py): each converted verb answers with its dataclass, printed as the
same JSON it always was, and the controller parses that JSON into the same dataclass. An unknown key, a missing
key or a value of the wrong type is ONE AgentError naming the target, the verb and the key; an agent of another
protocol version is still refused by its version, whatever the shape of its `ping` answer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflashops.agent.answers import (
    ANSWERS,
    AnswerMismatch,
    GpusAnswer,
    LaunchAnswer,
    PingAnswer,
    RestartAnswer,
    StopAnswer,
    answer_json,
    parse_answer,
)
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


# A stop's answer of each shape (agent/stop.py, run_lock.py joined_answer): its keys, as the verb's dict had them.
COMMON = {
    "escalated": False,
    "signalled": [],
    "gpu_released": None,
    "waited_for_checkpoint_s": 0.0,
    "before_start": False,
    "exit_code": 143,
    "seconds": 0.5,
    "recorded": True,
}
STOP_SHAPES = {
    "stopped": {**COMMON, "launcher_exit_code": None, "supervisor_cancelled": False},
    "stopped under a launcher": {**COMMON, "launcher_exit_code": 1, "supervisor_cancelled": True},
    "before its job started": {**COMMON, "before_start": True, "launcher_exit_code": None},
    "now": {**COMMON, "escalated": True, "exit_code": 137, "launcher_exit_code": None, "now": True},
    "now, while another command holds the run": {**COMMON, "now": True, "recorded": None},
    "a cancelled automatic restart": {**COMMON, "exit_code": 1, "supervisor_cancelled": True},
    "a hand-over": {
        **COMMON,
        "handover": {"checkpoint": "/ws/runs/r1/checkpoints/step_000010", "step": 10},
        "signalled": [4242],
        "gpu_released": True,
        "exit_code": None,
        "supervisor_cancelled": False,
    },
    "joined": {
        **COMMON,
        "joined": {"op": "restart", "pid": 7, "since": 1.0, "outcome": {"name": "r2"}, "finished_at": 2.0},
        "state": "stopped",
        "checkpoints": ["step_000010"],
    },
}


@pytest.mark.parametrize("shape", list(STOP_SHAPES))
def test_a_stop_answer_of_each_shape_survives_its_json_with_the_same_keys_and_values(shape: str) -> None:
    raw = STOP_SHAPES[shape]
    stop = parse_answer("stop", StopAnswer, {"ok": True, **raw})
    assert answer_json(stop) == raw  # the same keys (a null `launcher_exit_code` too) and values
    assert all(key in stop for key in raw) and "nodes" not in stop
    again = parse_answer("restart", RestartAnswer, {"ok": True, **RESTART, "stop": answer_json(stop)})
    assert again.stop is not None and answer_json(again.stop) == raw


RESTART = {
    "stop": None,
    "old_status": {
        "name": "r1",
        "state": "stopped",
        "exit_code": 143,
        "launcher_exit_code": None,
        "tmux": {},
        "pids": [],
        "pgid": None,
        "step": 10,
        "error_line": None,
        "ended_at": 1.0,
        "trainer_status": None,
        "last_metrics": None,
        "last_log_line": None,
        "checkpoints": ["step_000010"],
        "run_dir": "/ws/runs/r1",
        "run_json": {},
    },
    "release": "0" * 16,
    "path": "/ws/releases/" + "0" * 16,
    "removed": [],
    "checkpoint": None,
    "run_dir": "/ws/runs/r2",
    "pgid": 4243,
    "marker": "r2.abc",
    "launcher": "nohup",
    "session": "r2",
    "standby": False,
    "preflight": None,
    "cleared": {"removed": ["/ws/cache/compile/x"], "bytes": 10, "files": 1},
}


def test_a_restart_answer_holds_its_stop_its_old_run_and_its_launch() -> None:
    restart = parse_answer("restart", RestartAnswer, {"ok": True, **RESTART})
    assert restart.stop is None and restart.old_status.state == "stopped" and restart.cleared is not None
    assert restart.cleared.bytes == 10 and answer_json(restart) == RESTART
    assert list(answer_json(restart)) == list(RESTART)  # the order of the dict it was
    launch = {key: RESTART[key] for key in ("run_dir", "pgid", "marker", "launcher", "session", "standby")}
    launched = parse_answer("launch", LaunchAnswer, {"ok": True, **launch, "preflight": {"ok": True}, "cleared": None})
    assert launched.cleared is None and launched.preflight == {"ok": True} and launched.pgid == 4243


@pytest.mark.parametrize(
    ("verb", "answer", "message"),
    [
        ("stop", {k: v for k, v in STOP_SHAPES["stopped"].items() if k != "escalated"}, "missing key 'escalated'"),
        ("stop", {**STOP_SHAPES["stopped"], "nodes": []}, "unknown key 'nodes'"),
        ("stop", {**STOP_SHAPES["stopped"], "seconds": "0.5"}, "key 'seconds' must be float, not str"),
        ("restart", {**RESTART, "stop": {**COMMON, "ok": True}}, "unknown key 'stop.ok'"),
        ("restart", {**RESTART, "stop": {**COMMON, "recorded": "yes"}}, "key 'stop.recorded' must be bool or None"),
        ("restart", {**RESTART, "cleared": {"removed": [], "bytes": 0}}, "missing key 'cleared.files'"),
        ("launch", {"run_dir": "/ws/runs/r2", "pgid": 1}, "missing key 'marker'"),
    ],
)
def test_a_stop_launch_or_restart_answer_that_does_not_fit_is_one_error_naming_the_verb_and_the_key(
    verb: str, answer: dict, message: str
) -> None:
    with pytest.raises(AnswerMismatch) as refused:
        parse_answer(verb, ANSWERS[verb], {"ok": True, **answer})
    assert str(refused.value).startswith(f"{verb} answer: {message}")


def test_a_real_launch_and_stop_answer_what_their_dataclasses_print_back(tmp_path: Path) -> None:
    agent = real_agent(tmp_path)
    workspace = agent.target.workspace
    request = {"workspace": workspace, "name": "r1", "launcher": "nohup", "argv": ["sleep", "30"]}
    raw = agent.call("launch", request)
    launched = parse_answer("launch", LaunchAnswer, raw)
    assert json.dumps({"ok": True, **answer_json(launched)}) == json.dumps(raw)
    assert launched.run_dir.endswith("/runs/r1") and launched.standby is False and launched.cleared is None
    raw = agent.call("stop", {"workspace": workspace, "name": "r1", "grace": 5})
    stopped = parse_answer("stop", StopAnswer, raw)
    assert json.dumps({"ok": True, **answer_json(stopped)}) == json.dumps(raw)
    assert "launcher_exit_code" in raw and stopped.launcher_exit_code is None and stopped.exit_code == 143
