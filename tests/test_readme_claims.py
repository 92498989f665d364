"""The README's checkable claims about the repository hold (issue 46 item 6: it said "three worker processes"
when the Makefile ran four, and "some tens of seconds" for a deploy measured at ~8 s). Each claim is read from the
README's own words and compared with what defines it: the Makefile, the shipped inventory, the CLI's parsers and
the status table; a measured time must cite a dated bench/results/*.md entry that exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PROSE = re.sub(r"\s+", " ", README)  # claims wrap across lines
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "eight": 8}


def claim(pattern: str, text: str = PROSE) -> re.Match[str]:
    found = re.search(pattern, text)
    assert found, f"the README no longer says /{pattern}/: update this test with it"
    return found


def test_test_worker_count_is_the_makefiles() -> None:
    makefile = re.search(r"^TEST_WORKERS \?= (\d+)$", (REPO / "Makefile").read_text(), re.M)
    assert makefile, "the Makefile no longer sets TEST_WORKERS"
    workers = int(makefile.group(1))
    setup = re.sub(r"\s+", " ", (REPO / "docs/setup.md").read_text())
    for page, text in (("README.md", PROSE), ("docs/setup.md", setup)):
        said = claim(r"tests in (\w+) worker processes", text).group(1)
        assert NUMBERS.get(said, said) == workers, f"{page} says {said} test workers, the Makefile runs {workers}"


def test_shipped_targets_and_profiles_are_the_inventorys() -> None:
    inventory = yaml.safe_load((REPO / "inventory.yaml").read_text())
    local = inventory["targets"]["local"]
    said = claim(r"the `local` target \(this machine, workspace `([^`/]+)/?`\)")
    assert said.group(1) == local["workspace"]
    sentence = claim(r"and the profiles (.+?)\. `dflashops --help`").group(1)
    assert set(re.findall(r"`([\w.-]+)`", sentence)) == set(inventory["profiles"])  # `make demo-real` has a space
    tiny = claim(r"`(\w[\w-]*)` \(the tiny CPU preset, (\d+) steps\)", sentence)
    argv = inventory["profiles"][tiny.group(1)]["argv"]
    assert argv[argv.index("--max-steps") + 1] == tiny.group(2)


def test_stop_grace_and_runs_verbs_are_the_parsers() -> None:
    from dflashops.cli.main import build_parser

    grace = claim(r"SIGKILL after `--grace` \(default (\d+) s\)").group(1)
    stop = build_parser("stop")._subparsers._group_actions[0].choices["stop"]
    assert stop.get_default("grace") == float(grace)
    runs = build_parser("runs")._subparsers._group_actions[0].choices["runs"]
    verbs = set(runs._subparsers._group_actions[0].choices)
    listed = claim(r"\*\*runs\*\* is the lineage, kept in `lineage.sqlite` next to the inventory: ([^.]+)\.").group(1)
    assert set(re.findall(r"`(\w+)`", listed)) <= verbs


def test_status_columns_are_the_tables() -> None:
    from dflashops.cli.run_table import COLUMNS

    said = claim(r"dflashops status # one table: ([^\n]+?) dflashops logs").group(1)
    assert [c.strip() for c in said.split(",")] == list(COLUMNS)


def test_a_measured_time_cites_a_results_entry() -> None:
    timed = claim(r"`deploy` and `restart` take ([^;]+);")
    cited = claim(r'(bench/results/[\w-]+\.md) "([^"]+)"', timed.group(1))
    results, title = (REPO / cited.group(1)).read_text(), cited.group(2)
    assert f"## {title}" in results, title
