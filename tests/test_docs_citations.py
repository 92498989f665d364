"""Citations of the documentation resolve: every `docs/<page>.md#<heading>` cited in the repository, and every link
from README.md and between the pages of docs/, names a page that exists and a heading on it; no file cites notes that are not in
the repository (the design and method notes the code once cited lived outside it: issue 18)."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".txt"}
SKIP_DIRS = {"__pycache__", "node_modules", "demo-workspace", "fetched", "runs"}
CITATION = re.compile(r"\bdocs/([\w-]+\.md)(?:#([\w-]+))?")
LINK = re.compile(r"\]\(([^)\s]*)\)")
OUTSIDE_NOTES = re.compile(r"\b(?:DESIGN|METHOD)\.md\b")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {
        anchor(line.lstrip("#")) for line in page.read_text(encoding="utf-8").splitlines() if re.match(r"#{1,6} ", line)
    }


def repository_files() -> list[Path]:
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        found += [Path(root) / f for f in files if Path(f).suffix in TEXT_SUFFIXES or f == "Makefile"]
    return sorted(found)


def broken(page: str, fragment: str | None) -> str | None:
    target = DOCS / page
    if not target.is_file():
        return f"no page docs/{page}"
    if fragment and fragment not in anchors(target):
        return f"no heading #{fragment} on docs/{page}"
    return None


def test_cited_docs_exist() -> None:
    problems, cited = [], 0
    for path in repository_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in CITATION.finditer(text):
            cited += 1
            problem = broken(match.group(1), match.group(2))
            if problem:
                problems.append(f"{path.relative_to(REPO)}: {match.group(0)}: {problem}")
    assert cited > 20, "the scan found (almost) no citations: has it stopped reading the repository?"
    assert problems == []


def link_problems(page: Path) -> tuple[int, list[str]]:
    """How many relative links `page` has, and those that name no file or, with `#anchor`, no heading there."""
    problems, checked = [], 0
    for link in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in link or link.startswith("mailto:"):
            continue
        checked += 1
        name, _, fragment = link.partition("#")
        target = (page.parent / name).resolve() if name else page
        if not target.exists():
            problems.append(f"{page.name}: ({link}): no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            problems.append(f"{page.name}: ({link}): no heading #{fragment}")
    return checked, problems


def test_links_from_the_readme_and_between_docs_resolve(tmp_path: Path) -> None:
    """Every relative markdown link of README.md and docs/*.md names an existing file and, with `#anchor`, a
    heading on it (issue 30 item 5: the README points into docs/, the pages into each other)."""
    (tmp_path / "a.md").write_text("# A page\n\n## Its `part`: two\n")
    made_up = tmp_path / "b.md"
    made_up.write_text("[ok](a.md#its-part-two) [self](#b) [gone](c.md) [bad](a.md#nope) [web](https://x.org/y)\n# B\n")
    assert link_problems(made_up) == (4, ["b.md: (c.md): no such file", "b.md: (a.md#nope): no heading #nope"])
    problems, checked = [], 0
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        count, found = link_problems(page)
        checked += count
        problems += found
    assert checked > 40, "the scan found (almost) no links: has it stopped reading the pages?"
    assert problems == []


def test_nothing_cites_notes_outside_the_repository() -> None:
    here = Path(__file__).resolve()
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in repository_files()
        if path != here
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE_NOTES.search(line)
    ]
    assert found == [], "cite docs/ instead"
