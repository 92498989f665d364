"""The notification courier: `python -m dflashops.ops.courier`, started detached by a CLI call that queued
notifications (ops/notify.py, Invocation.close), so that no control path ever waits for a webhook or a command.

It reads its settings from stdin (the ledger's path, the webhook URL, which is a secret and so never on a
command line, the notify command, the timeout and the retry waits), takes the ledger's courier lock (one
courier per ledger at a time; a second one waits, then looks for what the first did not see), and delivers
every due delivery: one POST or one command run, each bounded by the timeout; a failure is tried again after
each retry wait. It exits when nothing is left to try. Every outcome is recorded in the ledger; its own log is
`<ledger>.log` beside it.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dflashops.core.errors import DflashopsError
from dflashops.ops.notify import Ledger
from dflashops.transport.local import LocalTransport
from dflashops.transport.webhook import post_json

MAX_SLEEP_S = 60.0  # between looks while a retry is pending (a retry wait longer than this is looked at again)


def deliver(channel: str, payload: dict[str, Any], settings: dict[str, Any]) -> str | None:
    """One delivery; None when it went through, else a short reason (never the URL)."""
    timeout = float(settings.get("timeout_s") or 10.0)
    if channel == "webhook":
        url = settings.get("webhook")
        return post_json(url, payload, timeout=timeout) if url else "no webhook URL"
    env = {
        "DFLASHOPS_EVENT": str(payload.get("event")),
        "DFLASHOPS_RUN": str(payload.get("run")),
        "DFLASHOPS_TARGET": str(payload.get("target") or ""),
        "DFLASHOPS_MESSAGE": str(payload.get("message")),
    }
    try:
        result = LocalTransport(name="notify").run(
            list(settings["command"]), env=env, check=False, stdin=json.dumps(payload).encode(), timeout=timeout
        )
    except DflashopsError as exc:
        return exc.message
    if result.exit_code != 0:
        return f"exit code {result.exit_code}: {(result.stderr.strip().splitlines() or [''])[-1]}"
    return None


def run(settings: dict[str, Any]) -> None:
    ledger_file = Path(settings["ledger"])
    retry_s = tuple(float(s) for s in settings.get("retry_s") or ())
    lock = os.open(f"{ledger_file}.courier", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # each delivery is bounded, so whoever holds it lets go in time
    ledger = Ledger(ledger_file)
    try:
        while True:
            due = ledger.due(retry_s)
            if not due:
                wait = ledger.next_try_in(retry_s)
                if wait is None:
                    return
                time.sleep(min(wait, MAX_SLEEP_S))
                continue
            for event_id, channel, payload in due:
                if channel in ("webhook", "command") and ledger.claim(event_id, channel, retry_s):
                    error = deliver(channel, payload, settings)
                    ledger.done(event_id, channel, error)
                    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                    print(f"{stamp} {event_id} {channel}: {error or 'sent'}", flush=True)
    finally:
        ledger.close()
        os.close(lock)


def main() -> int:
    run(json.loads(sys.stdin.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
