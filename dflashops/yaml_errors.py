"""One wording for YAML syntax errors in dflashops' files (inventory, playbooks): `FILE:LINE: invalid YAML: ...`."""

from __future__ import annotations

from pathlib import Path

import yaml

YAML_HINT = "check indentation and quoting on that line"


def describe_yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """`path:line: invalid YAML: problem` (the line is 1-based; omitted when PyYAML gives no mark)."""
    mark = getattr(exc, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    return f"{path}{line}: invalid YAML: {getattr(exc, 'problem', exc)}"
