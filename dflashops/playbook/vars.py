"""Playbook variables: `{{name}}`, `{{name.field}}`, `{{name.list[0]}}` substitution (no eval).

`render(value, scope)` substitutes recursively through strings, lists and mappings, and through variable
values that hold templates themselves (a default such as "restart of {{run}}"); a string that is exactly
one `{{...}}` keeps the value's type, so `extra_args: "{{point.args}}"` stays a list.
"""

from __future__ import annotations

import re
from typing import Any

from dflashops.core.errors import UsageError

TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)\s*\}\}")
MAX_DEPTH = 8


class PlaybookError(UsageError):
    """The playbook is not valid; nothing ran. The message starts with `file:line:`."""


def templated(value: Any) -> bool:
    return isinstance(value, str) and TEMPLATE.search(value) is not None


def references(value: Any) -> list[str]:
    """The first names of every `{{...}}` in a value (strings, lists and mappings, recursively)."""
    if isinstance(value, str):
        return [match.group(1) for match in TEMPLATE.finditer(value)]
    if isinstance(value, dict):
        return [name for item in value.values() for name in references(item)]
    if isinstance(value, list):
        return [name for item in value for name in references(item)]
    return []


def render(value: Any, scope: dict[str, Any], depth: int = 0) -> Any:
    """Substitute `{{...}}` in strings (recursively, also inside variable values such as a default of
    "restart of {{run}}"); an exact `{{x}}` keeps x's type."""
    if depth > MAX_DEPTH:
        raise PlaybookError(f"variables refer to each other too deeply near {value!r}")
    if isinstance(value, str):
        whole = TEMPLATE.fullmatch(value.strip())
        if whole:
            return render(_resolve(whole, scope), scope, depth + 1)
        return TEMPLATE.sub(lambda match: str(render(_resolve(match, scope), scope, depth + 1)), value)
    if isinstance(value, dict):
        return {key: render(item, scope, depth) for key, item in value.items()}
    if isinstance(value, list):
        return [render(item, scope, depth) for item in value]
    return value


def _resolve(match: re.Match[str], scope: dict[str, Any]) -> Any:
    if match.group(1) not in scope:
        raise PlaybookError(f"variable {match.group(1)!r} has no value here")
    current: Any = scope[match.group(1)]
    for part in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\[\d+\]", match.group(2)):
        try:
            current = current[int(part[1:-1])] if part.startswith("[") else current[part]
        except (KeyError, IndexError, TypeError):
            raise PlaybookError(f"{match.group(0)}: no {part!r} in {current!r}") from None
    return current
