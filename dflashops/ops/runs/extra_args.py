"""Extra trainer arguments (`deploy ... -- ARGS`) merged into a profile's command line.

The profile's argv stays the one source of each option: an extra `--max-steps 5000` REPLACES the profile's
`--max-steps 200` in place instead of being appended after it (argparse's last-one-wins would run the right
value, but run.json, the lineage and `runs diff` would show `--max-steps [200 5000]`). Options whose profile
value holds a placeholder such as `{run_dir}` (and those of `resume_args`) are managed by dflashops: it
tracks the run through them (checkpoints under `--output-dir {run_dir}`, resume from `{checkpoint}`), so an
extra argument may not set them. An option given twice after `--` is refused as well: which one counts
would depend on the trainer's parser.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dflashops.core.errors import UsageError
from dflashops.lineage.diff import is_flag

PLACEHOLDER_RE = re.compile(r"\{([a-z_]+)\}")

Item = tuple[str | None, list[str]]  # (flag, its words) for an option; (None, [word]) for a positional word


def split_options(argv: Sequence[str]) -> list[Item]:
    """argv as options with their values (`--flag value`, `--flag=value`, a bare `--flag`) and positional
    words, in order; everything after a `--` word is positional."""
    items: list[Item] = []
    words = [str(w) for w in argv]
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            items.extend((None, [w]) for w in words[index:])
            break
        if is_flag(word):
            flag = word.partition("=")[0]
            takes_next = (
                "=" not in word
                and index + 1 < len(words)
                and not is_flag(words[index + 1])
                and words[index + 1] != "--"
            )
            items.append((flag, words[index : index + (2 if takes_next else 1)]))
            index += 2 if takes_next else 1
        else:
            items.append((None, [word]))
            index += 1
    return items


def managed_flags(argv_template: Sequence[str], resume_args: Sequence[str]) -> dict[str, str]:
    """flag -> its templated value, for the profile options dflashops manages (the value has a placeholder)."""
    managed: dict[str, str] = {}
    for flag, words in split_options([*argv_template, *resume_args]):
        value = " ".join(words[1:]) or words[0].partition("=")[2]
        if flag is not None and PLACEHOLDER_RE.search(value):
            managed[flag] = value
    return managed


def merge_extra_args(argv: Sequence[str], extra: Sequence[str], managed: dict[str, str], profile: str) -> list[str]:
    """`argv` (the expanded profile command) with `extra` merged in: an option the profile has is replaced
    where it stands, anything else is appended. UsageError for a managed option or an option given twice."""
    merged = split_options(argv)
    seen: set[str] = set()
    for flag, words in split_options(extra):
        if flag is None:
            merged.append((None, words))
            continue
        if flag in managed:
            resume = "{checkpoint}" in managed[flag]
            raise UsageError(
                f"{flag} is managed by dflashops (profile {profile!r} sets it to {managed[flag]}) "
                "and cannot be given after --",
                hint="resume from a checkpoint of your choice with: dflashops restart RUN --resume --checkpoint "
                "STEP|PATH"
                if resume
                else "dflashops tracks the run through that value; change the profile in the inventory "
                "if it really must differ",
            )
        if flag in seen:
            raise UsageError(f"{flag} is given twice after --", hint="keep one of them")
        seen.add(flag)
        at = next((i for i, (f, _) in enumerate(merged) if f == flag), None)
        if at is None:
            merged.append((flag, words))
        else:
            merged[at] = (flag, words)
    return [word for _, words in merged for word in words]


def over(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """`base` (a parent run's extra arguments) with `extra` (a restart's `-- ARGS`) on top: an option `extra`
    gives replaces the same option of `base` where it stands, anything else is appended. `restart -- --lr 1e-3`
    keeps the parent's `--save-interval 50`."""
    merged = split_options(base)
    for flag, words in split_options(extra):
        at = None if flag is None else next((i for i, (f, _) in enumerate(merged) if f == flag), None)
        if at is None:
            merged.append((flag, words))
        else:
            merged[at] = (flag, words)
    return [word for _, words in merged for word in words]
