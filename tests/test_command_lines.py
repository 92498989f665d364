"""The exact command lines dflashops sends to a Proxmox host, checked without root, sshd or containers.

The Transport seam is replaced, and nothing else: `RecordingHost` stands where the ssh transport to the
Proxmox host would be, records every argv (with its stdin) that the real PctTransport and Agent build, and
answers with agent JSON like the real agent would. So on any laptop these tests pin down what the remote tier
(tests/remote/, root-only) runs for real: `sudo -n pct exec CTID --keep-env 0 -- env K=V python3 agent ...`,
the status check chained into the first exec, secrets only on stdin, the agent upload, the one-call restart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dflashops.core.errors import TransportError
from dflashops.core.inventory import load_inventory
from dflashops.core.shell import join_argv
from dflashops.ops.agent_client import _UPLOAD, Agent, agent_bytes
from dflashops.ops.invocation import Invocation
from dflashops.ops.runs.control import stop_run
from dflashops.transport.base import Stdin, Transport
from dflashops.transport.pct import STATUS_MARK, PctTransport
from dflashops.transport.ssh import SshSettings, SshTransport

Answer = Callable[[str, dict, bytes], tuple[int, str, str]]


@dataclass
class RecordingHost(Transport):
    """A stand-in for the ssh transport to the host: records (argv, stdin) and answers agent verbs."""

    answer: Answer | None = None
    calls: list[tuple[list[str], bytes]] = field(default_factory=list)

    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        data = stdin.read() if hasattr(stdin, "read") else (stdin or b"")
        self.calls.append((list(argv), bytes(data)))
        verb, request = agent_request(list(argv), bytes(data))
        code, out, err = (self.answer or default_answer)(verb, request, bytes(data))
        return code, out.encode(), err.encode()

    def stream(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None):
        raise TransportError("no streams here")


def agent_request(argv: list[str], stdin: bytes) -> tuple[str, dict]:
    """The agent verb and its request in an argv (whatever wraps it), from --json-args or stdin."""
    index = next((i for i, word in enumerate(argv) if "/.dflashops/agent-" in word and word.endswith(".pyz")), None)
    if index is None or index + 1 >= len(argv) or argv[index - 1] == "-c" or argv[index - 2] == "-c":
        return "", {}
    verb, rest = argv[index + 1], argv[index + 2 :]
    if "--json-args" in rest:
        return verb, json.loads(rest[rest.index("--json-args") + 1])
    if stdin:
        return verb, json.loads(stdin.split(b"\n", 1)[0])
    return verb, {}


def default_answer(verb: str, request: dict, stdin: bytes) -> tuple[int, str, str]:
    answers = {
        "status": {"runs": []},
        "ping": {"version": 1},
        "stop": {
            "escalated": False,
            "signalled": [4242],
            "gpu_released": None,
            "waited_for_checkpoint_s": 0.0,
            "before_start": False,
            "exit_code": 143,
            "launcher_exit_code": None,
            "seconds": 0.2,
            "recorded": True,
            "supervisor_cancelled": False,
        },
    }
    return 0, json.dumps({"ok": True, **answers.get(verb, {})}) + "\n", ""


INVENTORY = """\
hosts:
  pve: {address: 198.51.100.7, user: ops, sudo: true}
targets:
  ct200: {kind: pct, host: pve, ctid: 200, workspace: /workspace, python: /workspace/venv/bin/python}
profiles:
  work:
    argv: ["{python}", "{release}/workload.py", --output-dir, "{run_dir}"]
    files: [workload.py]
    packages: []
    pass_env: [DB_PASS]
"""


@pytest.fixture
def remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An Invocation whose ct200 agent runs through a PctTransport over a RecordingHost (no network at all)."""
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "workload.py").write_text("print('hi')\n")
    inventory = load_inventory(tmp_path / "inventory.yaml")
    host = RecordingHost(name="pve")
    pct = PctTransport(name="ct200", host=host, ctid=200, sudo=True)
    invocation = Invocation(inventory)
    invocation._agents["ct200"] = Agent(inventory.target("ct200"), pct)
    yield invocation, host
    invocation.close()


AGENT_PATH = "/workspace/.dflashops/agent-{}.pyz"


def agent_path() -> str:
    import hashlib

    return AGENT_PATH.format(hashlib.sha256(agent_bytes()).hexdigest()[:12])


def test_the_first_command_chains_pct_status_and_later_ones_exec_directly(remote) -> None:
    invocation, host = remote
    agent = invocation.agent(invocation.inventory.target("ct200"))
    agent.call("status", {"workspace": "/workspace"})
    agent.call("status", {"workspace": "/workspace"})
    first, second = host.calls[0][0], host.calls[1][0]
    exec_tail = [
        "sudo",
        "-n",
        "pct",
        "exec",
        "200",
        "--keep-env",
        "0",
        "--",
        "/workspace/venv/bin/python",
        agent_path(),
        "status",
        "--json-args",
        '{"workspace": "/workspace"}',
    ]
    assert first[:2] == ["sh", "-c"] and "sudo -n pct status 200" in first[2] and STATUS_MARK in first[2]
    assert first[3:] == ["dflashops-pct", *exec_tail]
    assert second == exec_tail


def test_a_missing_agent_is_uploaded_atomically_then_the_call_repeated(remote) -> None:
    invocation, host = remote
    missing = {"first": True}

    def answer(verb: str, request: dict, stdin: bytes) -> tuple[int, str, str]:
        if verb and missing["first"]:
            missing["first"] = False
            return 2, "", f"python: can't open file '{agent_path()}': [Errno 2] No such file or directory\n"
        return default_answer(verb, request, stdin)

    host.answer = answer
    invocation.agent(invocation.inventory.target("ct200")).call("status", {"workspace": "/workspace"})
    upload_argv, upload_stdin = host.calls[1]
    assert upload_argv[-4:] == ["/workspace/venv/bin/python", "-c", _UPLOAD, agent_path()]
    assert upload_stdin == agent_bytes()
    assert host.calls[2][0][-3] == "status" and len(host.calls) == 3


def test_secrets_travel_on_stdin_only(remote, monkeypatch: pytest.MonkeyPatch) -> None:
    invocation, host = remote
    monkeypatch.setenv("DB_PASS", "hunter2-not-on-argv")
    agent = invocation.agent(invocation.inventory.target("ct200"))
    agent.call(
        "launch",
        {"workspace": "/workspace", "name": "r1"},
        secret_args={"env": {"DB_PASS": "hunter2-not-on-argv"}},
        shown_args={"env": {"DB_PASS": "<redacted>"}},
    )
    argv, stdin = host.calls[-1]
    assert "hunter2-not-on-argv" not in join_argv(argv) and argv[-2:] == ["launch", "--json-stdin"]
    assert json.loads(stdin)["env"] == {"DB_PASS": "hunter2-not-on-argv"}


def test_stop_is_one_agent_verb_and_never_a_kill_by_name(remote) -> None:
    invocation, host = remote
    stop_run(invocation, "exp-flex5", target="ct200", grace=30.0)
    lines = [join_argv(argv) for argv, _ in host.calls]
    verbs = [agent_request(argv, stdin)[0] for argv, stdin in host.calls]
    assert verbs == ["stop", "status"]
    assert agent_request(*host.calls[0])[1] == {
        "workspace": "/workspace",
        "name": "exp-flex5",
        "grace": 30.0,
        "save_grace": 600.0,
    }
    by_name = re.compile(r"\bp?kill(all)?\b|\bkill-(session|server)\b|\brm -rf\b")  # what the hand chain typed
    assert not any(by_name.search(line) for line in lines)


def test_dry_run_plans_are_the_command_lines_a_real_run_would_use(remote) -> None:
    invocation, host = remote
    agent = invocation.agent(invocation.inventory.target("ct200"))
    agent.call("status", {"workspace": "/workspace"})  # the agent is there (first call, real)
    agent.dry_run = True
    agent.call("gc", {"workspace": "/workspace", "keep": 3})
    assert agent.plan == [
        f'[ct200] /workspace/venv/bin/python {agent_path()} gc --json-args \'{{"keep": 3, "workspace": "/workspace"}}\''
    ]
    assert len(host.calls) == 1  # the planned call did not run


def test_ssh_command_strings_quote_every_word_once() -> None:
    ssh = SshTransport(name="pve", settings=SshSettings(host="198.51.100.7"))  # nothing connects until a command
    line = ssh.command_line(["sh", "-c", 'echo "$HOME"; rm -rf /', "a b"], {"K": "v w", "EMPTY": ""})
    assert line == "env 'K=v w' EMPTY= sh -c 'echo \"$HOME\"; rm -rf /' 'a b'"
