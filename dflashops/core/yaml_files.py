"""Reading dflashops' YAML files (inventory, playbooks) safely, with one wording for their errors.

A YAML file is input from a person, a repository or a colleague, so it gets bounds before PyYAML builds
anything from it (each refusal is one `FILE:LINE: ...` error):
- size: at most MAX_BYTES (an inventory is a few KB; a 10 MB file cost 81 s per command);
- encoding: UTF-8, the first bad byte named by line and column (not a UnicodeDecodeError traceback);
- shape, from the event stream (iterative, so it cannot overflow the stack): nesting at most MAX_DEPTH
  (PyYAML's composer recurses once per level: 50,000 `[` gave a RecursionError), and at most
  MAX_EXPANDED_NODES once every alias is expanded (a 639-byte "billion laughs" file of nested aliases
  expands to 9^9 nodes: 35 s and 3.4 GB before a MemoryError). Aliases of a normal size still work.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from dflashops.core.errors import DflashopsError, InventoryError

YAML_HINT = "check indentation and quoting on that line"
MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_EXPANDED_NODES = 100_000


def describe_yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """`path:line: invalid YAML: problem` (the line is 1-based; omitted when PyYAML gives no mark)."""
    mark = getattr(exc, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    return f"{path}{line}: invalid YAML: {getattr(exc, 'problem', exc)}"


def read_yaml_text(path: Path, *, what: str = "file", error: type[DflashopsError] = InventoryError) -> str:
    """The file's text, refused (raising `error`) when it is too large, not UTF-8, nested too deeply or
    expands too far through aliases. OSError is left to the caller, which knows what the file is for."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise error(
            f"{path}: the {what} is {size / 1e6:.1f} MB, more than the {MAX_BYTES >> 20} MiB a {what} may have",
            hint=f"is this the right file? dflashops reads a few KB of settings from a {what}",
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})",
            hint=f"save the {what} as UTF-8",
        ) from None
    check_yaml_shape(path, text, error=error)
    return text


def check_yaml_shape(path: Path, text: str, *, error: type[DflashopsError] = InventoryError) -> None:
    """Refuse nesting deeper than MAX_DEPTH and more than MAX_EXPANDED_NODES nodes once aliases are expanded,
    walking PyYAML's event stream (no nodes are built). Syntax errors are left to the real load, which words
    them with describe_yaml_error."""
    anchored: dict[str, int] = {}  # anchor -> the expanded size of its node (known once the node is closed)
    # One frame per open collection: its anchor and its expanded size so far (itself + finished children).
    frames: list[list] = [[None, 0]]
    try:
        for event in yaml.parse(text):
            line = event.start_mark.line + 1  # type: ignore[union-attr]  # parse() marks every event
            if isinstance(event, yaml.CollectionStartEvent):
                if len(frames) > MAX_DEPTH:
                    raise error(
                        f"{path}:{line}: nested more than {MAX_DEPTH} levels deep",
                        hint="flatten the structure; dflashops' files need a few levels",
                    )
                frames.append([event.anchor, 1])
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                anchor, size = frames.pop()
            elif isinstance(event, yaml.ScalarEvent):
                anchor, size = event.anchor, 1
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor not in anchored:
                    if any(frame[0] == event.anchor for frame in frames):
                        raise error(
                            f"{path}:{line}: the alias *{event.anchor} refers to itself",
                            hint="a recursive alias never ends; remove it",
                        )
                    continue  # an undefined alias: the real load reports it
                anchor, size = None, anchored[event.anchor]
            else:
                continue
            if anchor is not None:
                anchored[anchor] = size
            frames[-1][1] += size
            if sum(frame[1] for frame in frames) > MAX_EXPANDED_NODES:
                raise error(
                    f"{path}:{line}: aliases expand to more than {MAX_EXPANDED_NODES:,} values",
                    hint='write the values out, or use fewer nested aliases (a "billion laughs" file?)',
                )
    except yaml.YAMLError:
        return
