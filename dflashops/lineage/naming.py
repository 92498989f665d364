"""Run naming (`--name +`) and the W&B naming convention derived from the lineage.

`next_name("exp-ddtree-flex5", taken)` -> "exp-ddtree-flex6"; "execlock-v2" -> "execlock-v3"; a name
with no counter gets "-v2". The counter is the trailing 1-3 digits, so dates and years at the end of a
name ("run-2026", "sweep_2026-11-29") are not counters and get "-v2" instead of silently becoming 2027.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

from dflashops.core.errors import UsageError
from dflashops.core.shell import validate_name

_COUNTER = re.compile(r"^(?P<stem>.*?\D)(?P<counter>\d{1,3})$")
_ENDS_WITH_DATE = re.compile(r"\d{4}[-_.]\d{2}[-_.]\d{2}$")
_MAX_TRIES = 10_000


def _split_counter(name: str) -> tuple[str, int, int] | None:
    """(stem, counter, zero-padded width) when `name` ends in a counter, else None."""
    match = _COUNTER.match(name)
    if match is None or _ENDS_WITH_DATE.search(name):
        return None
    digits = match.group("counter")
    width = len(digits) if digits.startswith("0") else 0
    return match.group("stem"), int(digits), width


def next_name(parent: str, taken: Collection[str]) -> str:
    """The next free name after `parent` (see module doc); skips every name in `taken`.

    Raises UsageError when `parent` is not a valid name or the derived name is invalid (e.g. over 64
    characters), naming the offending value.
    """
    validate_name(parent, what="parent run name")
    split = _split_counter(parent)
    stem, counter, width = split if split else (f"{parent}-v", 1, 0)
    for _ in range(_MAX_TRIES):
        counter += 1
        candidate = f"{stem}{counter:0{width}d}"
        if candidate not in taken:
            return validate_name(candidate, what="derived run name")
    raise UsageError(f"no free name after {parent!r} in {_MAX_TRIES} tries", hint="pass --name NAME explicitly")


def lineage_root(name: str, parent_of: Callable[[str], str | None]) -> str:
    """The first ancestor of `name` (itself when it has no parent). Stops at a cycle or a missing parent."""
    seen = {name}
    current = name
    while (parent := parent_of(current)) is not None and parent not in seen:
        seen.add(parent)
        current = parent
    return current


def wandb_env(name: str, parent: str | None, note: str, root: str) -> dict[str, str]:
    """Environment for the launched trainer so W&B mirrors the lineage (issue 8, item 4).

    wandb itself reads WANDB_NAME (run name = dflashops run name), WANDB_RUN_GROUP (group = lineage root)
    and WANDB_NOTES; the trainer copies DFLASHOPS_RUN_PARENT / DFLASHOPS_RUN_NOTE into its wandb config so
    the parent and the hypothesis are searchable there too. None of these are secrets.
    """
    env = {"WANDB_NAME": name, "WANDB_RUN_GROUP": root, "DFLASHOPS_RUN_NAME": name}
    if parent:
        env["DFLASHOPS_RUN_PARENT"] = parent
    if note:
        env["WANDB_NOTES"] = note
        env["DFLASHOPS_RUN_NOTE"] = note
    return env


# How alike a typed name and a recorded one must be to be offered as "did you mean": difflib's ratio (matching
# characters over both lengths). Its 0.5 offered `t1` for `w1` (one of two characters): for a short name one
# character is half of it, and a name that differs in its stem is another run, not a typo. 0.75 keeps a typo of
# a longer name (`flx5` -> `flex5` 0.89, `dmeo` -> `demo` 0.75) and drops unrelated short ones.
CLOSE_RATIO = 0.75


def close_names(name: str, candidates: Collection[str], limit: int = 4) -> list[str]:
    """Recorded names a mistyped `name` may have meant, best first: the same name in another case; the same stem
    with another counter (`t3` -> `t1`, `t2`: the user remembered the series, not the number); a name it is the
    start of (`flex` -> `flex5`); else a name at least CLOSE_RATIO alike. Two names with counters and different
    stems (`w1`, `t1`) are never close, however short."""
    import difflib

    split = _split_counter(name)
    scored: list[tuple[float, str]] = []
    for candidate in set(candidates) - {name}:
        other = _split_counter(candidate)
        if candidate.lower() == name.lower():
            score = 2.0
        elif split and other and split[0] == other[0]:
            score = 1.5
        elif len(name) >= 2 and candidate.startswith(name):
            score = 1.2
        elif split and other and split[0].lower() != other[0].lower() and len(split[0]) < 3:
            continue  # `w1` vs `t1`: a short stem that differs is another series
        else:
            score = difflib.SequenceMatcher(None, name, candidate).ratio()
            if score < CLOSE_RATIO:
                continue
        scored.append((score, candidate))
    return [candidate for _, candidate in sorted(scored, key=lambda item: (-item[0], item[1]))[:limit]]
