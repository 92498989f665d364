"""Notifications against a real HTTP server on 127.0.0.1 and a real command: who sends what, once each, and
the webhook URL's secrets (userinfo, path, query) never stored or printed."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.controller.test_supervisor_local import profile, stop_supervisors, wait_supervisor

URL_SECRETS = ("hookpass", "T0SECRETPATH", "tok3n-in-query")


class Hook:
    """A webhook receiver: every POST's path, Authorization header and JSON body; `status` to answer."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        self.status = 200
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.posts.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://alerts:{URL_SECRETS[0]}@127.0.0.1:{self.server.server_port}/hooks/{URL_SECRETS[1]}?token={URL_SECRETS[2]}"

    def ids(self) -> list[str]:
        return [post["body"]["id"] for post in self.posts]


@pytest.fixture
def hook() -> Iterator[Hook]:
    receiver = Hook()
    yield receiver
    receiver.server.shutdown()


def configure(env: Env, hook: Hook, *, from_target: bool, events: str = "") -> Path:
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
    )
    return log


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
        code, out, err = env.cli("deploy", "--profile", "flaky", "--name", "nt", "--launcher", "nohup", capsys=capsys)
        assert code == 0, err
        wait_supervisor(env, "nt")
        # Sent by the supervisor itself (no controller call since the deploy), and `started` by the deploy:
        assert hook.ids() == [
            "nt:started",
            "nt:crashed",
            "nt-r1:auto-restarted",
            "nt-r1:crashed",
            "nt-r2:auto-restarted",
            "nt-r2:finished",
        ]
        assert {p["path"] for p in hook.posts} == {f"/hooks/{URL_SECRETS[1]}?token={URL_SECRETS[2]}"}
        assert {p["auth"] for p in hook.posts} == {"Basic " + base64.b64encode(b"alerts:hookpass").decode()}
        restart = hook.posts[2]["body"]
        assert (
            restart["parent"] == "nt" and "after exit 1 at step 7: RuntimeError: injected crash" in restart["message"]
        )
        assert restart["text"].startswith("dflashops: nt-r1 restarted nt")
        assert log.read_text().splitlines()[0].startswith("started nt ")  # the deploy ran the command once

        code, out, err2 = env.cli("status", capsys=capsys)  # the controller looks again: delivers the rest
        assert code == 0
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
        assert env.cli("status", capsys=capsys)[0] == 0 and len(log.read_text().splitlines()) == 6  # once each
        no_url_secret_anywhere(env, out, err, err2)
        assert "http://127.0.0.1:" in err and "/<redacted>" in err  # the shown form: scheme and host only
    finally:
        stop_supervisors(env.workspace)


def test_the_controller_sends_what_it_sees_and_retries_a_failed_webhook(
    env: Env, hook: Hook, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflashops.ops import notify

    configure(env, hook, from_target=False, events="crashed")
    hook.status = 500
    code, _, err = env.cli(
        "deploy",
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
    time.sleep(0.5)
    assert env.cli("logs", "cr", "-f", "--timeout", "30", capsys=capsys)[0] == 7  # crashed: logs -f exits 7
    assert hook.ids() == ["cr:crashed"]  # seen by the follow's final status; the server said 500
    code, _, err = env.cli("status", capsys=capsys)
    assert code == 0 and len(hook.posts) == 1  # a failure is not retried at once
    monkeypatch.setattr(notify, "RETRY_AFTER_S", 0.0)
    hook.status = 200
    code, out, err = env.cli("status", capsys=capsys)
    assert (
        code == 0 and hook.ids() == ["cr:crashed", "cr:crashed"] and "notified cr:crashed to http://127.0.0.1:" in err
    )
    assert env.cli("status", capsys=capsys)[0] == 0 and len(hook.posts) == 2  # delivered: never again
    body = hook.posts[-1]["body"]
    assert body["source"] == "controller" and body["exit_code"] == 1 and "injected crash at step 3" in body["message"]
    no_url_secret_anywhere(env, out, err)


def test_a_failed_webhook_warns_without_the_url(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    env.inventory.write_text(env.inventory.read_text() + "notify:\n  webhook: http://127.0.0.1:9/x/T0SECRETPATH\n")
    code, out, err = env.cli(
        "deploy",
        "--profile",
        "work",
        "--name",
        "wf",
        "--launcher",
        "nohup",
        "--",
        "--steps",
        "2",
        "--interval",
        "0",
        capsys=capsys,
    )
    assert code == 0  # the run is launched; the notification failure is a warning
    line = next(line for line in err.splitlines() if "notify webhook" in line)
    assert line.startswith("warning: notify webhook http://127.0.0.1:9/<redacted> failed for wf:started")
    assert "T0SECRETPATH" not in out + err
