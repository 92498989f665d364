"""What changed between two runs: arguments (aware of `--flag value` pairs), env, code hash, profile, target.

Arguments are compared as options, not as word lists: `--lr 1e-4 --bs 8` vs `--bs 8 --lr 3e-4` is one
change (`--lr`), and reordering flags is no change at all. Positional words (the program and verb) are
compared as a list.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflashops.lineage.record import RunRecord

Options = dict[str, str | list[str]]
_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$|^-\.\d+")
FLAG_PRESENT = "(set)"  # the value recorded for a boolean flag such as `--compile`
# Env keys that name the run itself (dflashops sets them from the lineage): they differ between every
# parent and child by construction, so showing them as "changes" would only bury the real ones.
IDENTITY_ENV_KEYS = frozenset(
    {
        "WANDB_NAME",
        "WANDB_RUN_GROUP",
        "WANDB_NOTES",
        "DFLASHOPS_RUN",
        "DFLASHOPS_RUN_NAME",
        "DFLASHOPS_RUN_PARENT",
        "DFLASHOPS_RUN_NOTE",
        "DFLASHOPS_RUN_ID",
    }
)
RUN_PLACEHOLDER, CODE_PLACEHOLDER = "{run}", "{code}"


def _normalise(value: str, run: RunRecord) -> str:
    """Replace the run's own name (as a whole path/name component) and code hash by placeholders, so
    `--output-dir /ws/runs/exp-flex5` vs `.../exp-flex6` and `releases/<hash>/...` are not reported as
    argument changes (the name is the run's identity; the code hash is diffed on its own)."""
    if run.name in value:  # the pattern is per run: compiled for each of 10,000 names it was 2/3 of `runs tree`
        value = re.sub(rf"(?<![A-Za-z0-9._-]){re.escape(run.name)}(?![A-Za-z0-9._-])", RUN_PLACEHOLDER, value)
    if len(run.code_hash) >= 8:
        value = value.replace(run.code_hash, CODE_PLACEHOLDER)
    return value


def is_flag(word: str) -> bool:
    """`--lr`, `-f`, `--lr=3e-4`; not `-`, and not a negative number (`-1`, `-1e-3`), which is a value."""
    return word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.match(word)


def parse_argv(argv: Sequence[str]) -> tuple[list[str], Options]:
    """Split argv into positional words and {flag: value}.

    `--flag value`, `--flag=value` and `-f value` give a value; a flag followed by another flag (or the
    end) is boolean and maps to FLAG_PRESENT; a repeated flag maps to the list of its values. Words
    after `--` are positional. Negative numbers (`-1`, `-1e-3`) are values, not flags.
    """
    positional: list[str] = []
    options: Options = {}
    words = [str(w) for w in argv]
    index = 0

    def put(flag: str, value: str) -> None:
        if flag in options:
            previous = options[flag]
            options[flag] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            options[flag] = value

    while index < len(words):
        word = words[index]
        if word == "--":
            positional.extend(words[index + 1 :])
            break
        if is_flag(word):
            flag, sep, value = word.partition("=")
            if sep:
                put(flag, value)
            elif index + 1 < len(words) and not is_flag(words[index + 1]) and words[index + 1] != "--":
                put(flag, words[index + 1])
                index += 1
            else:
                put(flag, FLAG_PRESENT)
        else:
            positional.append(word)
        index += 1
    return positional, options


@dataclass
class RunDiff:
    """Differences from run `a` to run `b`. Each `*_changed` maps a key to (value in a, value in b)."""

    a: str
    b: str
    args_added: dict[str, Any] = field(default_factory=dict)
    args_removed: dict[str, Any] = field(default_factory=dict)
    args_changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    positional: tuple[list[str], list[str]] | None = None
    env_added: dict[str, str] = field(default_factory=dict)
    env_removed: dict[str, str] = field(default_factory=dict)
    env_changed: dict[str, tuple[str, str]] = field(default_factory=dict)
    fields_changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # code_hash, profile, target, ...

    @property
    def empty(self) -> bool:
        """True when the two runs were launched identically (same args, env, code, profile, target)."""
        return not any(
            (
                self.args_added,
                self.args_removed,
                self.args_changed,
                self.positional,
                self.env_added,
                self.env_removed,
                self.env_changed,
                self.fields_changed,
            )
        )

    def lines(self) -> list[str]:
        """Human lines, one change each: `+ --flag value`, `- --flag value`, `~ --flag old -> new`."""
        out: list[str] = []
        for key, (old, new) in self.fields_changed.items():
            out.append(f"~ {key}: {_short(old)} -> {_short(new)}")
        if self.positional:
            out.append(f"~ command: {' '.join(self.positional[0])} -> {' '.join(self.positional[1])}")
        out += [f"+ {flag} {_fmt(value)}" for flag, value in self.args_added.items()]
        out += [f"- {flag} {_fmt(value)}" for flag, value in self.args_removed.items()]
        out += [f"~ {flag} {_fmt(old)} -> {_fmt(new)}" for flag, (old, new) in self.args_changed.items()]
        out += [f"+ env {key}={value}" for key, value in self.env_added.items()]
        out += [f"- env {key}={value}" for key, value in self.env_removed.items()]
        out += [f"~ env {key}: {old} -> {new}" for key, (old, new) in self.env_changed.items()]
        return out

    def summary(self, limit: int = 4) -> str:
        """One short line for the tree view, e.g. `--lr 1e-4->3e-4, +--compile, code 1a2b->3c4d`."""
        parts: list[str] = []
        if "code_hash" in self.fields_changed:
            old, new = self.fields_changed["code_hash"]
            parts.append(f"code {_short(old)}->{_short(new)}")
        parts += [f"{flag} {_fmt(old)}->{_fmt(new)}" for flag, (old, new) in self.args_changed.items()]
        parts += [f"add {flag}" + ("" if v == FLAG_PRESENT else f" {_fmt(v)}") for flag, v in self.args_added.items()]
        parts += [f"drop {flag}" for flag in self.args_removed]
        parts += [f"env {key}" for key in [*self.env_added, *self.env_removed, *self.env_changed]]
        parts += [f"{key} {old}->{new}" for key, (old, new) in self.fields_changed.items() if key != "code_hash"]
        if not parts:
            return "no change"
        shown = ", ".join(parts[:limit])
        return shown + (f", +{len(parts) - limit} more" if len(parts) > limit else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for `runs diff --json` (pairs become {"a": ..., "b": ...})."""

        def pairs(d: dict[str, tuple[Any, Any]]) -> dict[str, dict[str, Any]]:
            return {key: {"a": old, "b": new} for key, (old, new) in d.items()}

        return {
            "a": self.a,
            "b": self.b,
            "empty": self.empty,
            "args": {"added": self.args_added, "removed": self.args_removed, "changed": pairs(self.args_changed)},
            "positional": None if self.positional is None else {"a": self.positional[0], "b": self.positional[1]},
            "env": {"added": self.env_added, "removed": self.env_removed, "changed": pairs(self.env_changed)},
            "fields": pairs(self.fields_changed),
        }


def _fmt(value: Any) -> str:
    """A repeated flag's values as `[a b]` (argparse keeps the last for a plain option, all for append)."""
    return "[" + " ".join(value) + "]" if isinstance(value, list) else str(value)


def _short(value: Any) -> str:
    text = "-" if value in (None, "") else str(value)
    return text[:12] if len(text) == 40 or len(text) == 64 else text  # full sha1/sha256 hashes -> 12 chars


def diff_runs(a: RunRecord, b: RunRecord) -> RunDiff:
    """Compare two run records (a = before, typically the parent; b = after). Each run's own name and
    code hash inside argv/env values count as placeholders; IDENTITY_ENV_KEYS are not compared."""
    diff = RunDiff(a=a.name, b=b.name)
    pos_a, opts_a = parse_argv([_normalise(word, a) for word in a.argv])
    pos_b, opts_b = parse_argv([_normalise(word, b) for word in b.argv])
    if pos_a != pos_b:
        diff.positional = (pos_a, pos_b)
    diff.args_added = {k: v for k, v in opts_b.items() if k not in opts_a}
    diff.args_removed = {k: v for k, v in opts_a.items() if k not in opts_b}
    diff.args_changed = {k: (opts_a[k], opts_b[k]) for k in opts_a if k in opts_b and opts_a[k] != opts_b[k]}
    env_a = {k: _normalise(v, a) for k, v in a.env.items() if k not in IDENTITY_ENV_KEYS}
    env_b = {k: _normalise(v, b) for k, v in b.env.items() if k not in IDENTITY_ENV_KEYS}
    diff.env_added = {k: v for k, v in env_b.items() if k not in env_a}
    diff.env_removed = {k: v for k, v in env_a.items() if k not in env_b}
    diff.env_changed = {k: (env_a[k], env_b[k]) for k in env_a if k in env_b and env_a[k] != env_b[k]}
    for name in ("code_hash", "profile", "target", "gpus", "launcher"):
        old, new = getattr(a, name), getattr(b, name)
        if old != new:
            diff.fields_changed[name] = (old, new)
    return diff
