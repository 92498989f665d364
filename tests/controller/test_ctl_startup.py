"""Start-up cost of the scripted verbs: `restart`/`deploy` import only their own verb module (no rich, no
playbook engine); help and unknown verbs still see every verb."""

from __future__ import annotations

import subprocess
import sys

from dflashops.cli.main import verb_of
from tests.controller.helpers import REPO

PROBE = """
import sys
from dflashops.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
heavy = sorted(m for m in ("rich", "dflashops.playbook", "dflashops.cli.fanout", "dflashops.cli.runs") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def probe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_verb_word_is_found_past_the_inventory_option() -> None:
    assert verb_of(["--inventory", "x.yaml", "restart", "r1"]) == "restart"
    assert verb_of(["--inventory=x.yaml", "stop", "r1"]) == "stop"
    assert verb_of(["--help"]) is None and verb_of([]) is None


def test_restart_path_skips_heavy_imports_and_help_lists_every_verb() -> None:
    for argv in (["restart", "--help"], ["--inventory", "nowhere.yaml", "deploy", "--help"], ["stop", "--help"]):
        out = probe(argv)
        assert "HEAVY=\n" in out.stdout, (argv, out.stdout)
    out = probe(["bogus"])
    assert "invalid choice" in out.stderr and "restart" in out.stderr and "watch" in out.stderr
