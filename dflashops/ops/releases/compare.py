"""Which files differ between two releases of a target (`runs diff` of runs with different code hashes).

Each release's manifest (relative path -> sha256, written at install) is read on the target with the agent's
`manifest` verb; a release that is no longer there (gc keeps the newest few) makes the answer "not known",
never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashops.agent.answers import ManifestAnswer
from dflashops.agent.protocol import ManifestRequest
from dflashops.ops.agent_client import Agent


@dataclass
class FileChanges:
    """`changed`: (M|A|D, path) sorted by path; `unknown`: why they could not be told (else None)."""

    changed: list[tuple[str, str]] = field(default_factory=list)
    unknown: str | None = None

    def lines(self) -> list[str]:
        if self.unknown:
            return [f"files: not known ({self.unknown})"]
        if not self.changed:
            return ["files: none differ (the same files under both hashes)"]
        what = {"M": "changed", "A": "added", "D": "removed"}
        return [f"file {what[kind]}: {path}" for kind, path in self.changed]

    def to_dict(self) -> dict[str, object]:
        return {"changed": [{"how": kind, "path": path} for kind, path in self.changed], "unknown": self.unknown}


def release_manifest(agent: Agent, code_hash: str) -> dict[str, str] | None:
    """The manifest of release `code_hash` on the agent's target, or None when that release is not there."""
    answer = agent.ask("manifest", ManifestRequest(workspace=agent.target.workspace, release=code_hash), ManifestAnswer)
    return answer.files if answer is not None and answer.release == code_hash else None


def compare(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str]]:
    """(M|A|D, path) for every path whose sha256 differs, that only `new` has, or only `old` has."""
    paths = sorted(set(old) | set(new))
    return [
        ("A" if path not in old else "D" if path not in new else "M", path)
        for path in paths
        if old.get(path) != new.get(path)
    ]


def file_changes(old_agent: Agent, old_hash: str, new_agent: Agent, new_hash: str) -> FileChanges:
    """What differs between release `old_hash` (on `old_agent`'s target) and `new_hash` (on `new_agent`'s)."""
    manifests = []
    for agent, code_hash in ((old_agent, old_hash), (new_agent, new_hash)):
        files = release_manifest(agent, code_hash)
        if files is None:
            return FileChanges(unknown=f"release {code_hash[:12]} is no longer on {agent.target.name}: gc removed it")
        manifests.append(files)
    return FileChanges(compare(manifests[0], manifests[1]))
