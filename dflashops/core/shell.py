"""The one place where an argv list becomes a shell string, and where names are validated.

Everything that reaches a remote command line (run names, session names, env keys, paths) is checked
here first; a bad value is a `UsageError` raised before any command runs.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from dflashops.agent.common import is_safe_name  # the one name rule; the agent applies it on the target
from dflashops.core.errors import UsageError

ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def join_argv(argv: Sequence[str]) -> str:
    """Quote each argument with shlex so the string runs exactly `argv` in a POSIX shell."""
    return " ".join(shlex.quote(str(arg)) for arg in argv)


def env_argv(env: Mapping[str, str]) -> list[str]:
    """`env K=V ...` prefix for a command (values are passed as argv items, never re-parsed)."""
    for key in env:
        validate_env_key(key)
    return ["env", *(f"{key}={value}" for key, value in env.items())]


def validate_name(value: str, *, what: str = "name") -> str:
    """A run, session, profile or target name: `[A-Za-z0-9._-]`, 1-64 chars, not `.`/`..`, no leading `-`."""
    if not is_safe_name(value or ""):
        raise UsageError(
            f"invalid {what} {value!r}: use 1-64 characters from A-Z a-z 0-9 . _ - (no '..', no leading '-')",
            hint="pick a name like exp-flex3 or run_2026-11-29",
        )
    return value


def validate_env_key(key: str) -> str:
    if not ENV_KEY_RE.match(key or ""):
        raise UsageError(f"invalid environment variable name {key!r}", hint="use letters, digits and _ only")
    return key
