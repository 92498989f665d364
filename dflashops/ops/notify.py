"""Run notifications from the controller: a JSON POST to `notify.webhook` and/or `notify.command` run here.

Who sends what (README "Notifications"): the controller sends what it sees itself (a launch -> `started`; a
state change that status/stop/watch/logs/restart observe -> `crashed`, `stalled`, `finished`, `stopped`) and
delivers the events the in-target supervisor recorded in a run's events.jsonl (`auto-restarted`, `gave-up`,
...) the next time it looks. With `notify.from_target`, the supervisor POSTs them itself at once (laptop
asleep); an event it delivered is not POSTed again, the command still runs here (it is a controller command).

Every event has an id `<run>:<event>`; a ledger next to the lineage database (`lineage.sqlite-notify`, SQLite)
claims (id, channel) before sending, so two CLI processes looking at the same change send it once. A failed
delivery is tried again by a later look, at most MAX_ATTEMPTS times, RETRY_AFTER_S apart, so an unreachable
webhook costs each `status` at most one timeout per event, not forever. The ledger keeps each event's
payload, so a failed delivery is retried even when nothing changes any more (`retry_due`, once per CLI call).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from dflashops.inventory import Inventory, Notify
from dflashops.inventory_policy import shown_url

MAX_ATTEMPTS = 3
RETRY_AFTER_S = 60.0
STALE_SENDING_S = 120.0  # a claim whose sender died (killed mid-POST) is free again after this


class Ledger:
    """(event id, channel) -> sent / failed / sending, in one SQLite file with WAL."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path, timeout=15, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS deliveries (id TEXT, channel TEXT, status TEXT NOT NULL, "
            "attempts INTEGER NOT NULL, last_try REAL NOT NULL, payload TEXT NOT NULL DEFAULT '{}', "
            "PRIMARY KEY (id, channel))"
        )

    def due(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, channel, payload) of failed deliveries whose next try is due."""
        now = time.time()
        rows = self._conn.execute(
            "SELECT id, channel, payload FROM deliveries WHERE (status = 'failed' AND attempts < ? "
            "AND last_try <= ?) OR (status = 'sending' AND last_try <= ?)",
            (MAX_ATTEMPTS, now - RETRY_AFTER_S, now - STALE_SENDING_S),
        ).fetchall()
        return [(event_id, channel, json.loads(payload)) for event_id, channel, payload in rows]

    def claim(self, event_id: str, channel: str, payload: dict[str, Any] | None = None) -> bool:
        """True when this process should send now (nobody sent it, nobody is sending it, retries left)."""
        now = time.time()
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            row = self._conn.execute(
                "SELECT status, attempts, last_try FROM deliveries WHERE id = ? AND channel = ?", (event_id, channel)
            ).fetchone()
            if row is None:
                self._conn.execute(
                    "INSERT INTO deliveries VALUES (?, ?, 'sending', 1, ?, ?)",
                    (event_id, channel, now, json.dumps(payload or {})),
                )
                return True
            status, attempts, last_try = row
            free = (status == "failed" and attempts < MAX_ATTEMPTS and now - last_try >= RETRY_AFTER_S) or (
                status == "sending" and now - last_try >= STALE_SENDING_S
            )
            if free:
                self._conn.execute(
                    "UPDATE deliveries SET status = 'sending', attempts = attempts + 1, last_try = ? "
                    "WHERE id = ? AND channel = ?",
                    (now, event_id, channel),
                )
            return free
        finally:
            self._conn.execute("COMMIT")

    def done(self, event_id: str, channel: str, ok: bool) -> None:
        self._conn.execute(
            "INSERT INTO deliveries VALUES (?, ?, ?, 1, ?, '{}') ON CONFLICT (id, channel) DO UPDATE "
            "SET status = excluded.status, last_try = excluded.last_try",
            (event_id, channel, "sent" if ok else "failed", time.time()),
        )

    def close(self) -> None:
        self._conn.close()


class Notifier:
    """Sends events for one CLI invocation; `notices` collects what happened (the CLI prints them)."""

    def __init__(self, inventory: Inventory) -> None:
        self.config: Notify | None = inventory.notify
        self.path = inventory.lineage_path.with_name(inventory.lineage_path.name + "-notify")
        self.notices: list[str] = []
        self._ledger: Ledger | None = None
        self._retried = False

    @property
    def url(self) -> str | None:
        config = self.config
        if config is None:
            return None
        return config.webhook or (os.environ.get(config.webhook_env) if config.webhook_env else None)

    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.path)
        return self._ledger

    def send(self, event: dict[str, Any], *, delivered_by_target: bool = False) -> None:
        """Deliver one event on every configured channel that has not had it yet."""
        config = self.config
        if config is None or event.get("event") not in config.events:
            return
        self.retry_due()
        payload = {**{k: v for k, v in event.items() if k != "webhook"}, "text": f"dflashops: {event.get('message')}"}
        url = self.url
        if config.webhook_env and url is None and self.ledger().claim(event["id"], "webhook-env"):
            self.notices.append(
                f"warning: notify.webhook_env {config.webhook_env} is not set; {event['id']} not POSTed"
            )
            self.ledger().done(event["id"], "webhook-env", True)  # said once per event
        if url and delivered_by_target:
            self.ledger().done(event["id"], "webhook", True)
        elif url and self.ledger().claim(event["id"], "webhook", payload):
            self.deliver("webhook", payload)
        if config.command and self.ledger().claim(event["id"], "command", payload):
            self.deliver("command", payload)

    def deliver(self, channel: str, payload: dict[str, Any]) -> None:
        """Send one claimed delivery and record how it went."""
        config, event_id = self.config, str(payload.get("id"))
        assert config is not None
        if channel == "webhook":
            from dflashops.transport.webhook import post_json

            url = self.url or ""
            failure = post_json(url, payload, timeout=config.timeout_s) if url else "no webhook URL"
            self.notices.append(
                f"notified {event_id} to {shown_url(url)}"
                if failure is None
                else f"warning: notify webhook {shown_url(url)} failed for {event_id}: {failure}"
            )
        else:
            failure = self.run_command(config, payload)
            if failure:
                self.notices.append(f"warning: notify command for {event_id} failed: {failure}")
        self.ledger().done(event_id, channel, failure is None)

    def retry_due(self) -> None:
        """Once per CLI call: deliveries that failed earlier and are due again (their payloads are kept)."""
        if self._retried or self.config is None or not self.path.exists():
            return
        self._retried = True
        for event_id, channel, payload in self.ledger().due():
            if channel in ("webhook", "command") and payload and self.ledger().claim(event_id, channel):
                self.deliver(channel, payload)

    def run_command(self, config: Notify, payload: dict[str, Any]) -> str | None:
        from dflashops.errors import DflashopsError
        from dflashops.transport.local import LocalTransport

        env = {
            "DFLASHOPS_EVENT": str(payload.get("event")),
            "DFLASHOPS_RUN": str(payload.get("run")),
            "DFLASHOPS_TARGET": str(payload.get("target") or ""),
            "DFLASHOPS_MESSAGE": str(payload.get("message")),
        }
        try:
            result = LocalTransport(name="notify").run(
                list(config.command), env=env, check=False, stdin=json.dumps(payload).encode(), timeout=config.timeout_s
            )
        except DflashopsError as exc:
            return exc.message
        if result.exit_code != 0:
            return f"exit code {result.exit_code}: {(result.stderr.strip().splitlines() or [''])[-1]}"
        return None

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
