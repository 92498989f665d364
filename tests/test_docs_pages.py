"""The README stays the first hour and the reference stays findable (issue 30 item 5): the README is at most 200
lines, and every page of docs/ is listed in docs/README.md, which the README links."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MOST_LINES = 200
LINK = re.compile(r"\]\(([^)\s#]*)(?:#[^)\s]*)?\)")


def linked(page: Path) -> set[Path]:
    """The files that the relative markdown links of `page` name (anchors dropped)."""
    text = page.read_text(encoding="utf-8")
    return {(page.parent / name).resolve() for name in LINK.findall(text) if name and "://" not in name}


def test_the_readme_stays_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert 40 < len(lines) <= README_MOST_LINES, f"README.md has {len(lines)} lines: move reference into docs/"


def test_every_docs_page_is_in_the_index_and_the_index_in_the_readme() -> None:
    assert (DOCS / "README.md").resolve() in linked(REPO / "README.md")
    pages = {page.resolve() for page in DOCS.glob("*.md")} - {(DOCS / "README.md").resolve()}
    assert len(pages) >= 10, sorted(pages)  # the scan reads docs/ (eleven pages when this was written)
    missing = sorted(page.name for page in pages - linked(DOCS / "README.md"))
    assert missing == [], f"docs/README.md does not list {missing}"
