"""Run notifications from the controller: a JSON POST to `notify.webhook` and/or `notify.command` run here.

Who sends what (docs/notifications.md): the controller sends what it sees itself (a launch -> `started`; a
state change that status/stop/watch/logs/restart observe -> `crashed`, `stalled`, `finished`, `stopped`) and
delivers the events the in-target supervisor recorded in a run's events.jsonl (`auto-restarted`, `gave-up`,
...) the next time it looks. With `notify.from_target`, the supervisor POSTs them itself at once (laptop
asleep); an event it delivered is not POSTed again, the command still runs here (it is a controller command).

Nothing here sits on a control path: `send` only queues. Every event has an id `<run>:<event>`; a ledger next
to the lineage database (`lineage.sqlite-notify`, SQLite) holds one row per (event id, channel), so two CLI
processes that see the same change queue it once. When the invocation closes, a detached courier process
(ops/courier.py) delivers what is due, each POST or command bounded by `notify.timeout`, a failed one again
after each wait of `notify.retry` (default 5 s, then 30 s: three tries), and records every outcome in the
ledger. A delivery that failed for good is reported once, as a warning, by the next CLI call.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from dflashops.core.inventory import Inventory, Notify
from dflashops.core.inventory_policy import shown_url
from dflashops.transport.detach import start_detached

STALE_SENDING_S = 120.0  # a claim whose courier died mid-delivery is free again after this
COLUMNS = {"error": "TEXT", "reported": "INTEGER NOT NULL DEFAULT 0"}  # added after the first ledger format


class Ledger:
    """(event id, channel) -> queued / sending / sent / failed, with its payload, tries and last error; one
    SQLite file with WAL, shared by every CLI call and the courier."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path, timeout=15, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS deliveries (id TEXT, channel TEXT, status TEXT NOT NULL, "
            "attempts INTEGER NOT NULL, last_try REAL NOT NULL, payload TEXT NOT NULL DEFAULT '{}', "
            "PRIMARY KEY (id, channel))"
        )
        have = {row[1] for row in self._conn.execute("PRAGMA table_info(deliveries)")}
        for column, kind in COLUMNS.items():
            if column not in have:
                try:
                    self._conn.execute(f"ALTER TABLE deliveries ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError:  # another process added it a moment ago
                    pass

    def enqueue(self, event_id: str, channel: str, payload: dict[str, Any]) -> bool:
        """Queue one delivery; False when this (event, channel) was queued (or sent) before."""
        cursor = self._conn.execute(
            "INSERT OR IGNORE INTO deliveries (id, channel, status, attempts, last_try, payload) "
            "VALUES (?, ?, 'queued', 0, 0, ?)",
            (event_id, channel, json.dumps(payload)),
        )
        return cursor.rowcount == 1

    def record(self, event_id: str, channel: str, error: str | None) -> None:
        """An outcome decided elsewhere (the supervisor POSTed it from the target)."""
        self._conn.execute(
            "INSERT INTO deliveries (id, channel, status, attempts, last_try, error) VALUES (?, ?, ?, 1, ?, ?) "
            "ON CONFLICT (id, channel) DO UPDATE SET status = excluded.status, last_try = excluded.last_try, "
            "error = excluded.error",
            (event_id, channel, "sent" if error is None else "failed", time.time(), error),
        )

    def due(self, retry_s: tuple[float, ...]) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, channel, payload) of every delivery to make now: queued, failed with tries left whose wait is
        over, or claimed by a courier that died."""
        now = time.time()
        rows = self._conn.execute(
            "SELECT id, channel, payload, status, attempts, last_try FROM deliveries "
            "WHERE status IN ('queued', 'failed', 'sending')"
        ).fetchall()
        return [
            (event_id, channel, json.loads(payload))
            for event_id, channel, payload, status, attempts, last_try in rows
            if self._ready(status, attempts, last_try, now, retry_s)
        ]

    def next_try_in(self, retry_s: tuple[float, ...]) -> float | None:
        """Seconds until the next failed delivery may be tried again; None when none has tries left."""
        now = time.time()
        waits = [
            last_try + retry_s[attempts - 1] - now
            for attempts, last_try in self._conn.execute(
                "SELECT attempts, last_try FROM deliveries WHERE status = 'failed'"
            ).fetchall()
            if 1 <= attempts <= len(retry_s)
        ]
        return max(0.0, min(waits)) if waits else None

    def claim(self, event_id: str, channel: str, retry_s: tuple[float, ...]) -> bool:
        """True when this process should deliver it now (it is due and nobody else claimed it meanwhile)."""
        now = time.time()
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            row = self._conn.execute(
                "SELECT status, attempts, last_try FROM deliveries WHERE id = ? AND channel = ?", (event_id, channel)
            ).fetchone()
            if row is None or not self._ready(row[0], row[1], row[2], now, retry_s):
                return False
            self._conn.execute(
                "UPDATE deliveries SET status = 'sending', attempts = attempts + 1, last_try = ? "
                "WHERE id = ? AND channel = ?",
                (now, event_id, channel),
            )
            return True
        finally:
            self._conn.execute("COMMIT")

    def done(self, event_id: str, channel: str, error: str | None) -> None:
        self._conn.execute(
            "UPDATE deliveries SET status = ?, last_try = ?, error = ? WHERE id = ? AND channel = ?",
            ("sent" if error is None else "failed", time.time(), error, event_id, channel),
        )

    def pending(self, retry_s: tuple[float, ...]) -> bool:
        """Something is queued, or failed with tries left: a courier has work."""
        return bool(self.due(retry_s)) or self.next_try_in(retry_s) is not None

    def failed_for_good(self, retry_s: tuple[float, ...]) -> list[tuple[str, str, str]]:
        """(id, channel, error) of deliveries that used every try and were not reported yet; marks them
        reported (said once, by whichever call sees them first)."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            rows = self._conn.execute(
                "SELECT id, channel, error FROM deliveries WHERE status = 'failed' AND attempts > ? AND reported = 0",
                (len(retry_s),),
            ).fetchall()
            self._conn.execute(
                "UPDATE deliveries SET reported = 1 WHERE status = 'failed' AND attempts > ? AND reported = 0",
                (len(retry_s),),
            )
        finally:
            self._conn.execute("COMMIT")
        return [(event_id, channel, error or "unknown error") for event_id, channel, error in rows]

    @staticmethod
    def _ready(status: str, attempts: int, last_try: float, now: float, retry_s: tuple[float, ...]) -> bool:
        if status == "queued":
            return True
        if status == "failed":
            return 1 <= attempts <= len(retry_s) and now - last_try >= retry_s[attempts - 1]
        return status == "sending" and now - last_try >= STALE_SENDING_S

    def close(self) -> None:
        self._conn.close()


def ledger_path(inventory: Inventory) -> Path:
    return inventory.lineage_path.with_name(inventory.lineage_path.name + "-notify")


def courier_settings(config: Notify, ledger: Path) -> dict[str, Any]:
    """What the courier needs (ops/courier.py), the webhook URL included: it goes on the courier's stdin."""
    return {
        "ledger": str(ledger),
        "webhook": webhook_url(config),
        "command": list(config.command),
        "timeout_s": config.timeout_s,
        "retry_s": list(config.retry_s),
    }


def start_courier(settings: dict[str, Any]) -> None:
    """The courier (ops/courier.py) as a detached process of this machine's interpreter, with this package
    importable whatever the caller's working directory; its log is `<ledger>.log`."""
    package_root = str(Path(__file__).resolve().parents[2])  # dflashops/ops/ -> the folder holding dflashops
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    start_detached(
        [sys.executable, "-m", "dflashops.ops.courier"],
        stdin=json.dumps(settings).encode(),
        log=Path(f"{settings['ledger']}.log"),
        env={**os.environ, "PYTHONPATH": path},
    )


def webhook_url(config: Notify) -> str | None:
    return config.webhook or (os.environ.get(config.webhook_env) if config.webhook_env else None)


class Notifier:
    """Queues events for one CLI invocation and starts the courier when it closes; `notices` collects what
    the CLI prints (what was queued, a delivery that failed for good)."""

    def __init__(self, inventory: Inventory) -> None:
        self.config: Notify | None = inventory.notify
        self.path = ledger_path(inventory)
        self.notices: list[str] = []
        self._ledger: Ledger | None = None
        self._looked = False
        self._pending = False

    @property
    def url(self) -> str | None:
        return webhook_url(self.config) if self.config is not None else None

    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.path)
        return self._ledger

    def send(self, event: dict[str, Any], *, delivered_by_target: bool = False) -> bool:
        """Queue one event on every configured channel that has not had it yet (`delivered_by_target`: the
        supervisor POSTed it already; only the command channel is queued); True when it was queued anywhere."""
        config = self.config
        if config is None or event.get("event") not in config.events:
            return False
        self.look()
        payload = {**{k: v for k, v in event.items() if k != "webhook"}, "text": f"dflashops: {event.get('message')}"}
        url = self.url
        if config.webhook_env and url is None and self.ledger().enqueue(event["id"], "webhook-env", {}):
            self.notices.append(
                f"warning: notify.webhook_env {config.webhook_env} is not set; {event['id']} not POSTed"
            )
            self.ledger().record(event["id"], "webhook-env", None)  # said once per event
        queued = []
        if url and delivered_by_target:
            self.ledger().record(event["id"], "webhook", None)
        elif url and self.ledger().enqueue(event["id"], "webhook", payload):
            queued.append(shown_url(url))
        if config.command and self.ledger().enqueue(event["id"], "command", payload):
            queued.append("the notify command")
        if queued:
            self._pending = True
            self.notices.append(f"notification {event['id']} queued for {' and '.join(queued)}")
        return bool(queued)

    def look(self) -> None:
        """Once per CLI call: report the deliveries that failed for good since the last look, and note whether
        earlier deliveries are waiting for a courier (one that died, or retries that are due)."""
        if self._looked or self.config is None or not self.path.exists():
            return
        self._looked = True
        config = self.config
        for event_id, channel, error in self.ledger().failed_for_good(config.retry_s):
            where = f"webhook {shown_url(self.url or '')}" if channel == "webhook" else "command"
            self.notices.append(
                f"warning: notify {where} failed for {event_id} after {len(config.retry_s) + 1} tries: {error}"
            )
        self._pending = self._pending or self.ledger().pending(config.retry_s)

    def flush(self) -> None:
        """At the end of the invocation: hand what is queued to a courier (a detached process), when there is
        anything to deliver."""
        if self.config is not None and self._pending:
            start_courier(courier_settings(self.config, self.path))
            self._pending = False

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
