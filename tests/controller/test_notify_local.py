"""Notifications against a real HTTP server on 127.0.0.1 and a real command: who sends what, once each, the
webhook URL's secrets (userinfo, path, query) never stored or printed, and no control path waiting for a
webhook: the controller only queues (a detached courier process delivers), the supervisor POSTs from a thread.

Deliveries happen in the background, so the tests wait for the ledger's own state (nothing queued or being
sent, no courier holding its lock), never for a time."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.controller.test_supervisor_local import events, profile, stop_supervisors, wait_supervisor

URL_SECRETS = ("hookpass", "T0SECRETPATH", "tok3n-in-query")


class Hook:
    """A webhook receiver: every POST's path, Authorization header and JSON body; `statuses` to answer (the
    last one repeats); with `hold`, every answer waits until `release` is set (a webhook that hangs)."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        self.statuses = [200]
        self.release = threading.Event()
        self.release.set()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.posts.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                hook.release.wait(120)
                status = hook.statuses.pop(0) if len(hook.statuses) > 1 else hook.statuses[0]
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self) -> None:
        self.release.clear()

    @property
    def url(self) -> str:
        return f"http://alerts:{URL_SECRETS[0]}@127.0.0.1:{self.server.server_port}/hooks/{URL_SECRETS[1]}?token={URL_SECRETS[2]}"

    def ids(self) -> list[str]:
        return [post["body"]["id"] for post in self.posts]


@pytest.fixture
def hook() -> Iterator[Hook]:
    receiver = Hook()
    yield receiver
    receiver.release.set()
    receiver.server.shutdown()


def configure(env: Env, hook: Hook, *, from_target: bool, events: str = "", extra: str = "") -> Path:
    log = env.root / "command.log"
    command = (
        f"[\"{sys.executable}\", -c, \"import os,sys; open('{log}','a').write(os.environ['DFLASHOPS_EVENT'] + ' '"
        f" + os.environ['DFLASHOPS_RUN'] + ' ' + sys.stdin.read() + chr(10))\"]"
    )
    env.inventory.write_text(
        env.inventory.read_text()
        + profile(
            "flaky",
            f'--steps, "20", --save-every, "5", --crash-at, "7", --crash-times, "2", '
            f'--state-file, "{env.root / "starts"}"',
            "    on_failure: {max_restarts: 3, backoff: 0.1s}\n",
        )
        + f'notify:\n  webhook: "{hook.url}"\n  command: {command}\n  from_target: {str(from_target).lower()}\n'
        + (f"  events: [{events}]\n" if events else "")
        + extra
    )
    return log


def wait_delivered(env: Env, timeout: float = 120.0) -> None:
    """Until the ledger holds nothing queued or being sent, nothing waiting for a retry, and no courier holds
    its lock (a courier that waits out a retry holds it)."""
    ledger = env.root / "lineage.sqlite-notify"
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "the notifications were not delivered in time"
        free = False
        if ledger.exists():
            fd = os.open(f"{ledger}.courier", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free = True
            except BlockingIOError:
                pass
            finally:
                os.close(fd)  # closing releases it
            with sqlite3.connect(ledger) as conn:
                busy = conn.execute("SELECT count(*) FROM deliveries WHERE status IN ('queued', 'sending')").fetchone()
            if free and busy[0] == 0:
                return
        time.sleep(0.05)


def ledger_rows(env: Env) -> dict[tuple[str, str], tuple[str, int]]:
    with sqlite3.connect(env.root / "lineage.sqlite-notify") as conn:
        rows = conn.execute("SELECT id, channel, status, attempts FROM deliveries").fetchall()
    return {(event_id, channel): (status, attempts) for event_id, channel, status, attempts in rows}


def no_url_secret_anywhere(env: Env, *texts: str) -> None:
    # run dirs, run.json, lineage.sqlite, the ledger, logs: everything but the inventory the user wrote it in
    stored = b"".join(
        p.read_bytes() for p in sorted(env.root.rglob("*")) if p.is_file() and not p.is_symlink() and p != env.inventory
    )
    for secret in URL_SECRETS:
        assert secret.encode() not in stored and all(secret not in text for text in texts), secret


def test_the_supervisor_posts_while_the_controller_is_away_and_the_controller_runs_the_command(
    env: Env, hook: Hook, capsys: pytest.CaptureFixture[str]
) -> None:
    log = configure(env, hook, from_target=True)
    try:
        code, out, err = env.cli(
            "deploy", "--detach", "--profile", "flaky", "--name", "nt", "--launcher", "nohup", capsys=capsys
        )
        assert code == 0, err
        assert "notification nt:started queued for http://127.0.0.1:" in err
        wait_supervisor(env, "nt")
        wait_delivered(env)
        # Sent by the supervisor itself (no controller call since the deploy), in order; `started` by the
        # deploy's courier, at its own moment:
        from_supervisor = [
            "nt:crashed",
            "nt-r1:auto-restarted",
            "nt-r1:crashed",
            "nt-r2:auto-restarted",
            "nt-r2:finished",
        ]
        deadline = time.monotonic() + 60
        while len(hook.posts) < 6:
            assert time.monotonic() < deadline, hook.ids()
            time.sleep(0.05)
        assert [i for i in hook.ids() if i != "nt:started"] == from_supervisor
        assert sorted(hook.ids()) == sorted(["nt:started", *from_supervisor])
        assert {p["path"] for p in hook.posts} == {f"/hooks/{URL_SECRETS[1]}?token={URL_SECRETS[2]}"}
        assert {p["auth"] for p in hook.posts} == {"Basic " + base64.b64encode(b"alerts:hookpass").decode()}
        restart = next(p["body"] for p in hook.posts if p["body"]["id"] == "nt-r1:auto-restarted")
        assert (
            restart["parent"] == "nt" and "after exit 1 at step 7: RuntimeError: injected crash" in restart["message"]
        )
        assert restart["text"].startswith("dflashops: nt-r1 restarted nt")
        assert log.read_text().splitlines()[0].startswith("started nt ")  # the deploy ran the command once
        assert all(e["webhook"] == "sent" for e in events_seen(env, "nt-r1"))  # the supervisor's courier said so

        code, out, err2 = env.cli("status", capsys=capsys)  # the controller looks again: delivers the rest
        assert code == 0
        wait_delivered(env)
        assert len(hook.posts) == 6  # nothing POSTed twice
        ran = [line.split(" ", 2)[:2] for line in log.read_text().splitlines()]
        assert sorted(map(tuple, ran)) == sorted(
            [
                ("started", "nt"),
                ("crashed", "nt"),
                ("auto-restarted", "nt-r1"),
                ("crashed", "nt-r1"),
                ("auto-restarted", "nt-r2"),
                ("finished", "nt-r2"),
            ]
        )
        assert env.cli("status", capsys=capsys)[0] == 0
        wait_delivered(env)
        assert len(log.read_text().splitlines()) == 6  # once each
        no_url_secret_anywhere(env, out, err, err2)
        assert "http://127.0.0.1:" in err and "/<redacted>" in err  # the shown form: scheme and host only
    finally:
        stop_supervisors(env.workspace)


def events_seen(env: Env, run: str) -> list[dict]:
    """The run's events as the agent's status shows them (the courier's delivery lines folded in)."""
    return env.agent("status", {"workspace": str(env.workspace), "name": run})["runs"][0].get("events", [])


def test_the_controller_sends_what_it_sees_and_retries_a_failed_webhook(
    env: Env, hook: Hook, capsys: pytest.CaptureFixture[str]
) -> None:
    configure(env, hook, from_target=False, events="crashed", extra="  retry: [0.2s, 0.2s]\n")
    hook.statuses = [500, 200]  # the first try fails; the courier tries again by itself
    code, _, err = env.cli(
        "deploy",
        "--detach",
        "--profile",
        "work",
        "--name",
        "cr",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "10",
        "--crash-at",
        "3",
        "--interval",
        "0",
        capsys=capsys,
    )
    assert code == 0 and hook.posts == []  # `started` is not among the configured events
    code, _, err = env.cli("logs", "cr", "-f", "--timeout", "30", capsys=capsys)
    assert code == 7  # crashed: logs -f exits 7
    assert "notification" not in err  # logs only reads: the crash is left for a verb that acts on what it sees
    code, _, err = env.cli("status", "cr", capsys=capsys)
    assert code == 0 and "notification cr:crashed queued for http://127.0.0.1:" in err  # the observer's step
    wait_delivered(env)
    assert hook.ids() == ["cr:crashed", "cr:crashed"]  # the server said 500, then 200
    assert ledger_rows(env)[("cr:crashed", "webhook")] == ("sent", 2)
    code, out, err = env.cli("status", capsys=capsys)
    wait_delivered(env)
    assert code == 0 and len(hook.posts) == 2 and "warning" not in err  # delivered: never again
    body = hook.posts[-1]["body"]
    assert body["source"] == "controller" and body["exit_code"] == 1 and "injected crash at step 3" in body["message"]
    no_url_secret_anywhere(env, out, err)


def test_a_webhook_that_fails_for_good_is_a_warning_without_the_url(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    env.inventory.write_text(
        env.inventory.read_text() + "notify:\n  webhook: http://127.0.0.1:9/x/T0SECRETPATH\n  retry: [0.1s, 0.1s]\n"
    )
    # The run trains on until the test ends: a run that finished would queue a second event (`finished`) from the
    # status call that saw it, and whether its failed delivery landed before the last status call (a second warning)
    # depended on the machine's load.
    code, out, err = env.cli(
        "deploy",
        "--detach",
        "--profile",
        "work",
        "--name",
        "wf",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "100000",
        capsys=capsys,
    )
    assert code == 0  # the run is launched; the notification is only queued
    wait_delivered(env)
    assert ledger_rows(env)[("wf:started", "webhook")] == ("failed", 3)
    code, out2, err2 = env.cli("status", "wf", capsys=capsys)  # the next call says it, once
    assert code == 0
    line = next(line for line in err2.splitlines() if "notify webhook" in line)
    assert line.startswith("warning: notify webhook http://127.0.0.1:9/<redacted> failed for wf:started after 3 tries:")
    assert "notify webhook" not in env.cli("status", "wf", capsys=capsys)[2]
    assert "T0SECRETPATH" not in out + err + out2 + err2


def test_a_hanging_webhook_delays_neither_deploy_nor_an_auto_restart(
    env: Env, hook: Hook, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every POST hangs until the test releases it (timeout 60 s): `deploy` returns with its `started` only
    queued, and the supervisor restarts the crashed run while its `crashed` POST still hangs."""
    configure(env, hook, from_target=True, extra="  timeout: 60s\n")
    hook.hold()
    try:
        code, out, err = env.cli(
            "deploy", "--detach", "--profile", "flaky", "--name", "hw", "--launcher", "nohup", capsys=capsys
        )
        assert code == 0, err
        assert "notification hw:started queued" in err and "failed" not in err
        deadline = time.monotonic() + 60
        while not (env.runs / "hw" / "restarted_as").is_file():  # with the `crashed` POST hanging meanwhile
            assert time.monotonic() < deadline, "the auto-restart waited for the webhook"
            time.sleep(0.05)
        assert not hook.release.is_set() and "hw:crashed" in hook.ids()
        assert [e["webhook"] for e in events(env, "hw")] == ["queued"]
        hook.release.set()
        wait_supervisor(env, "hw")
        wait_delivered(env)
        deadline = time.monotonic() + 60
        while any(e.get("webhook") != "sent" for e in events_seen(env, "hw")):
            assert time.monotonic() < deadline, events_seen(env, "hw")
            time.sleep(0.05)
        assert ledger_rows(env)[("hw:started", "webhook")] == ("sent", 1)
    finally:
        hook.release.set()
        stop_supervisors(env.workspace)
