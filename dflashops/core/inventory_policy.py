"""The inventory's recovery and notification keys: `on_failure` and `stall` (per profile), `notify` (top level).

    profiles:
      NAME:
        on_failure: {resume: true, max_restarts: 3, backoff: 60s, exit_codes: [1, 137]}
        stall: {heartbeat: 15m, gpu_util_below: 5%, for: 10m, grace: 60s}
    notify:
      webhook: https://hooks.example.org/...     # JSON POST per event (or webhook_env: NAME: the URL from
      command: [notify-send, dflashops]          #  the controller's environment); command: argv run on the
      events: [crashed, stalled, auto-restarted] #  controller, event JSON on stdin; default: every event
      from_target: true                          # the in-container supervisor POSTs too (laptop asleep)
      timeout: 10s                               # each POST or command run, at most
      retry: [5s, 30s]                           # the waits before a failed delivery's second and third try

Durations are a number of seconds or a number with a unit: `500ms`, `90s`, `15m`, `1.5h`. Percentages are
`5%` or a bare number 0-100. Parsing goes through inventory.py's reader (duck-typed here: `fail`, `mapping`,
`scalar`, `str_list`, `int_list`), so every error names the file, the line and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

EVENTS = ("started", "crashed", "stalled", "auto-restarted", "gave-up", "finished", "stopped")
_DURATION = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclass(frozen=True)
class OnFailure:
    """Restart a failed run as a new child run (in the container, by the supervisor)."""

    resume: bool = True
    max_restarts: int = 3
    backoff_s: float = 60.0
    exit_codes: tuple[int, ...] = ()  # empty: every failure; else only these exit codes (a stall always counts)


@dataclass(frozen=True)
class Stall:
    """When a running run counts as stalled (stopped with SIGTERM, then handled as a failure)."""

    heartbeat_s: float | None = None  # no fresh status.json heartbeat, or no new step while training, this long
    gpu_util_below: float | None = None  # percent: every GPU of the run below this ...
    for_s: float = 600.0  # ... for this long, while status.json says "training"
    grace_s: float = 60.0  # SIGTERM -> SIGKILL for a stalled run


@dataclass(frozen=True)
class Notify:
    """Where run state changes are reported. `webhook` is a secret-bearing value: shown only as `shown_url`."""

    webhook: str | None = None
    webhook_env: str | None = None
    command: tuple[str, ...] = ()
    events: tuple[str, ...] = EVENTS
    from_target: bool = False
    timeout_s: float = 10.0
    retry_s: tuple[float, ...] = (5.0, 30.0)  # the waits before each try after the first (three tries)


def parse_duration(text: object) -> float | None:
    """Seconds for `90`, `90s`, `1.5m`, `2h`, `500ms`; None for anything else (bool included)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text) if text >= 0 else None
    match = _DURATION.match(str(text))
    return float(match.group("number")) * _UNIT_S[match.group("unit")] if match else None


def parse_percent(text: object) -> float | None:
    """0-100 from `5%`, `5` or `2.5%`; None otherwise."""
    if isinstance(text, bool):
        return None
    raw = str(text).strip().removesuffix("%")
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 <= value <= 100 else None


def shown_url(url: str) -> str:
    """A webhook URL as it may be printed or stored: scheme and host only. Userinfo, path and query can all
    carry the secret (Slack and Discord put the token in the path), so none of them is shown."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<redacted url>"
    rest = "/<redacted>" if (parts.path not in ("", "/") or parts.query or parts.username) else ""
    return f"{parts.scheme}://{host}{port}{rest}"


def _raw(reader: Any, node: Any, key: str) -> Any:
    """A scalar's YAML value (number, bool or text), with the reader's error for a non-scalar."""
    import yaml  # the inventory reader's own dependency; imported here so this module stays import-light

    if not isinstance(node, yaml.ScalarNode):
        raise reader.fail(node, key, "expected a single value")
    return yaml.safe_load(yaml.serialize(node))


def _duration(reader: Any, node: Any, key: str, *, positive: bool = True) -> float:
    seconds = parse_duration(_raw(reader, node, key))
    if seconds is None or (positive and seconds <= 0):
        raise reader.fail(node, key, "expected a duration such as 90s, 15m or 1h")
    return seconds


def parse_on_failure(reader: Any, node: Any, key: str) -> OnFailure:
    fields = reader.mapping(node, key, {"resume", "max_restarts", "backoff", "exit_codes"})
    values: dict[str, Any] = {}
    if "resume" in fields:
        values["resume"] = reader.scalar(fields["resume"], f"{key}.resume", bool)
    if "max_restarts" in fields:
        count = reader.scalar(fields["max_restarts"], f"{key}.max_restarts", int)
        if not 0 <= count <= 100:
            raise reader.fail(fields["max_restarts"], f"{key}.max_restarts", "expected 0-100")
        values["max_restarts"] = count
    if "backoff" in fields:
        values["backoff_s"] = _duration(reader, fields["backoff"], f"{key}.backoff", positive=False)
    if "exit_codes" in fields:
        codes = reader.int_list(fields["exit_codes"], f"{key}.exit_codes")
        if any(not 1 <= code <= 255 for code in codes):
            raise reader.fail(fields["exit_codes"], f"{key}.exit_codes", "exit codes are 1-255")
        values["exit_codes"] = codes
    return OnFailure(**values)


def parse_stall(reader: Any, node: Any, key: str) -> Stall:
    fields = reader.mapping(node, key, {"heartbeat", "gpu_util_below", "for", "grace"})
    if "heartbeat" not in fields and "gpu_util_below" not in fields:
        raise reader.fail(node, key, "set heartbeat (e.g. 15m) and/or gpu_util_below (e.g. 5%)")
    values: dict[str, Any] = {}
    if "heartbeat" in fields:
        values["heartbeat_s"] = _duration(reader, fields["heartbeat"], f"{key}.heartbeat")
    if "gpu_util_below" in fields:
        percent = parse_percent(_raw(reader, fields["gpu_util_below"], f"{key}.gpu_util_below"))
        if percent is None:
            raise reader.fail(fields["gpu_util_below"], f"{key}.gpu_util_below", "expected a percentage such as 5%")
        values["gpu_util_below"] = percent
    if "for" in fields:
        values["for_s"] = _duration(reader, fields["for"], f"{key}.for")
    if "grace" in fields:
        values["grace_s"] = _duration(reader, fields["grace"], f"{key}.grace", positive=False)
    return Stall(**values)


def parse_notify(reader: Any, node: Any, key: str = "notify") -> Notify:
    from dflashops.core.shell import ENV_KEY_RE

    fields = reader.mapping(
        node, key, {"webhook", "webhook_env", "command", "events", "from_target", "timeout", "retry"}
    )
    values: dict[str, Any] = {}
    if "webhook" in fields and "webhook_env" in fields:
        raise reader.fail(fields["webhook_env"], f"{key}.webhook_env", "give webhook or webhook_env, not both")
    if "webhook" in fields:
        url = reader.scalar(fields["webhook"], f"{key}.webhook", str)
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise reader.fail(fields["webhook"], f"{key}.webhook", "expected an http:// or https:// URL")
        values["webhook"] = url
    if "webhook_env" in fields:
        name = reader.scalar(fields["webhook_env"], f"{key}.webhook_env", str)
        if not ENV_KEY_RE.match(name):
            raise reader.fail(fields["webhook_env"], f"{key}.webhook_env", "invalid environment variable name")
        values["webhook_env"] = name
    if "command" in fields:
        command = reader.str_list(fields["command"], f"{key}.command")
        if not command:
            raise reader.fail(fields["command"], f"{key}.command", "must not be empty")
        values["command"] = command
    if "events" in fields:
        events = reader.str_list(fields["events"], f"{key}.events")
        unknown = [event for event in events if event not in EVENTS]
        if unknown or not events:
            problem = f"unknown event {unknown[0]!r}" if unknown else "must not be empty"
            raise reader.fail(fields["events"], f"{key}.events", f"{problem} (events: {', '.join(EVENTS)})")
        values["events"] = events
    if "from_target" in fields:
        values["from_target"] = reader.scalar(fields["from_target"], f"{key}.from_target", bool)
    if "timeout" in fields:
        values["timeout_s"] = _duration(reader, fields["timeout"], f"{key}.timeout")
    if "retry" in fields:
        waits = fields["retry"]
        if not isinstance(waits, yaml.SequenceNode) or len(waits.value) > 10:
            raise reader.fail(waits, f"{key}.retry", "expected a list of up to 10 durations such as [5s, 30s]")
        values["retry_s"] = tuple(_duration(reader, w, f"{key}.retry[{i}]") for i, w in enumerate(waits.value))
    if not (values.get("webhook") or values.get("webhook_env") or values.get("command")):
        raise reader.fail(node, key, "set webhook, webhook_env and/or command")
    return Notify(**values)
