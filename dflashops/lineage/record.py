"""The run record (one launch of the trainer) and the secret rules applied before anything is stored.

`RunRecord` is what the lineage database, `run.json` and `runs export` agree on. Secrets never reach it:
`redact_env` and `redact_argv` run on every record built, and again with `redact_value` (for `extra`) on every
row the database writes, so a caller that forgets to redact, or changes a record after building it, still
stores nothing secret (all three are idempotent). Rows read back are not redacted again (RunRecord.stored).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

STATES: tuple[str, ...] = ("launched", "running", "finished", "crashed", "stopped")
REDACTED = "<redacted>"

# Names that are secret whatever their value looks like.
_SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY|CREDENTIAL|COOKIE|AUTHORIZATION"
    r"|SESSION_?KEY|SIGNING_?KEY|(^|_)PAT($|_)",
    re.IGNORECASE,
)
# A bare KEY in the name (OPENAI_KEY, S3_KEY) is secret only when the value looks like one; this keeps
# harmless settings such as KEYMAP=us or SSH_KEY_PATH=/root/.ssh/id readable.
_KEY_NAME = re.compile(r"KEY", re.IGNORECASE)
_SECRET_LOOKING_VALUE = re.compile(r"^[A-Za-z0-9_\-+/=.:]{16,}$")
# Well-known token prefixes are secret under any variable name (hf_, sk-, GitHub, Slack, AWS, GitLab).
_TOKEN_PREFIX = re.compile(r"^(hf_|sk-|ghp_|gho_|ghs_|github_pat_|xox[abpr]-|AKIA|glpat-)[A-Za-z0-9_\-]{8,}")
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.\-]*://[^/\s:@]+:)(?P<password>[^@\s/]+)(?P<tail>@)", re.I)
# Command-line flags that carry a secret as their value (`--hf-token X`, `--api-key=X`).
_SECRET_FLAG = re.compile(r"^--?[A-Za-z0-9_-]*(token|secret|passw(or)?d|api[-_]?key|private[-_]?key)$", re.I)


def _value_is_secret(value: str) -> bool:
    return bool(_TOKEN_PREFIX.match(value))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Copy of `env` with every secret value replaced by "<redacted>" (the key stays, so diffs show it).

    Secret: a name containing TOKEN, SECRET, PASSWORD, API_KEY, ... (always); a name containing KEY whose
    value looks like a key (16+ characters of a key alphabet, not a path); any value that starts with a
    known token prefix (hf_, sk-, ghp_, ...). A password inside a URL (`https://u:pw@host`) is cut out.
    """
    redacted: dict[str, str] = {}
    for key, raw in env.items():
        value = "" if raw is None else str(raw)
        if value == REDACTED:
            redacted[key] = value
        elif _SECRET_NAME.search(key) or _value_is_secret(value):  # noqa: SIM114 - a rule of its own
            redacted[key] = REDACTED
        elif _KEY_NAME.search(key) and _SECRET_LOOKING_VALUE.match(value) and "/" not in value[:1]:
            redacted[key] = REDACTED
        else:
            redacted[key] = _URL_PASSWORD.sub(rf"\g<head>{REDACTED}\g<tail>", value)
    return redacted


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Copy of argv with the values of secret-looking flags (and token-looking words) redacted."""
    out: list[str] = []
    hide_next = False
    for word in (str(a) for a in argv):
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, sep, value = word.partition("=")
        if _SECRET_FLAG.match(flag):
            if sep:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(word)
                hide_next = True
            continue
        out.append(REDACTED if _value_is_secret(word) else _URL_PASSWORD.sub(rf"\g<head>{REDACTED}\g<tail>", word))
    return out


def redact_value(value: Any) -> Any:
    """`value` (a JSON value: a record's `extra`) with every string that is a known token (hf_, sk-, ...) replaced
    by "<redacted>" and passwords cut out of URLs, at any depth. Keys are kept as they are: names such as
    `max_tokens` are settings, not secrets."""
    if isinstance(value, str):
        return REDACTED if _value_is_secret(value) else _URL_PASSWORD.sub(rf"\g<head>{REDACTED}\g<tail>", value)
    if isinstance(value, list):
        return [redact_value(item) for item in value]
    if isinstance(value, dict):
        return {key: redact_value(item) for key, item in value.items()}
    return value


def utc_now_iso() -> str:
    """Current time as ISO 8601 UTC with seconds, e.g. 2026-11-29T07:10:00Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gpus(value: Any) -> list[int]:
    """GPU ids from a list, a single int, or a "0,1" string (inventories write all three)."""
    if value is None or value == "":
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        return [int(part) for part in value.replace(" ", "").split(",") if part]
    return [int(part) for part in value]


@dataclass
class RunRecord:
    """One run: who launched what, from which parent, with which hypothesis, and how it ended.

    `env` must hold no secrets (the database re-applies `redact_env` anyway). `state` is one of STATES.
    `extra` carries anything else worth keeping (pgid, run_dir, wandb group, best tau_sim, ...).
    """

    name: str
    parent: str | None = None
    note: str = ""
    code_hash: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    target: str = "local"
    gpus: list[int] = field(default_factory=list)
    launcher: str = "nohup"
    session: str = ""
    profile: str | None = None
    started_at: str = field(default_factory=utc_now_iso)
    state: str = "launched"
    exit_code: int | None = None
    last_step: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {self.state!r}")
        self.argv = redact_argv(self.argv)
        self.env = redact_env(self.env)
        self.gpus = _gpus(self.gpus)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (the `runs show --json` / `runs export` shape), a copy at every depth.
        Not dataclasses.asdict: its deepcopy of every value was half of `runs export`'s time at 10,000 rows."""
        return {name: _copy(getattr(self, name)) for name in _FIELD_NAMES}

    @classmethod
    def stored(cls, values: Mapping[str, Any]) -> RunRecord:
        """A record as the lineage database holds it, without `__post_init__`: every row was redacted when it
        was written (LineageDB._to_row), and redacting 10,000 rows again word by word on every read was most
        of `runs list`'s 41.6 s (issue 47)."""
        record = cls.__new__(cls)
        record.__dict__.update(values)
        return record


_FIELD_NAMES = tuple(RunRecord.__dataclass_fields__)


def _copy(value: Any) -> Any:
    """A copy of a JSON value (lists and dicts copied at every depth)."""
    if isinstance(value, list):
        return [_copy(item) for item in value]
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    return value


# run.json field names that differ from RunRecord's (docs/run-directory.md#runjson: `hypothesis` is the note).
_RUN_JSON_ALIASES = {"hypothesis": "note", "session_name": "session", "tmux_session": "session", "run": "name"}
_RECORD_FIELDS = set(RunRecord.__dataclass_fields__)


def record_from_run_json(data: Mapping[str, Any]) -> RunRecord:
    """Build a RunRecord from a run's `run.json`; unknown keys (pgid, release path, ...) land in `extra`.

    Raises ValueError when `name` is missing or the state is unknown (callers turn it into a user error).
    """
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = dict(data.get("extra") or {})
    for key, value in data.items():
        key = _RUN_JSON_ALIASES.get(key, key)
        if key == "extra":
            continue
        if key in _RECORD_FIELDS:
            fields[key] = value
        else:
            extra[key] = value
    if not fields.get("name"):
        raise ValueError("run.json has no 'name'")
    fields["extra"] = extra
    fields["note"] = fields.get("note") or ""
    fields["argv"] = list(fields.get("argv") or [])
    fields["env"] = dict(fields.get("env") or {})
    if fields.get("exit_code") is not None:
        fields["exit_code"] = int(fields["exit_code"])
    return RunRecord(**fields)
