"""Start-up cost of every call (issue 46 item 7; the times are bench/cli_startup.py's): `restart`/`deploy`
import only their own verb module (no rich, no playbook engine); `dflashops --help` imports no verb module, yet
lists every verb with its module's own help line; `status` with nothing running imports no rich. An unknown verb
is one `error:` line and the closest verb (issue 46 item 10), typed as a user would."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

from dflashops.cli.main import VERB_HELP, VERB_MODULE, verb_of
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
print("MODULES=" + ",".join(sorted(m for m in sys.modules if m.startswith(("dflashops", "rich", "yaml")))))
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
    out = probe(["--help"])
    assert "HEAVY=\n" in out.stdout, out.stdout
    for verb in VERB_MODULE:
        assert re.search(rf"^    {verb} ", out.stdout, re.M), (verb, out.stdout)


def loaded(out: subprocess.CompletedProcess[str]) -> set[str]:
    line = next(line for line in out.stdout.splitlines() if line.startswith("MODULES="))
    return set(line.removeprefix("MODULES=").split(","))


def test_help_imports_no_verb_module_and_status_imports_no_rich(tmp_path: Path) -> None:
    modules = loaded(probe(["--help"]))
    assert not {m for m in modules if m.startswith(("dflashops.cli.", "rich", "yaml"))} - {"dflashops.cli.main"}
    assert not {m for m in modules if m.startswith(("dflashops.ops", "dflashops.core.inventory", "dflashops.lineage"))}
    assert not {m for m in loaded(probe(["status", "--help"])) if m.startswith("rich")}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"targets:\n  local:\n    kind: local\n    workspace: ws\n    python: {sys.executable}\n")
    out = probe(["--inventory", str(inventory), "status"])
    assert "no runs on this target yet" in out.stderr and not {m for m in loaded(out) if m.startswith("rich")}


def test_the_static_help_lines_are_the_modules_own() -> None:
    """VERB_HELP (what `dflashops --help` prints without importing the verbs) says what each module registers."""
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    for module_name in dict.fromkeys(VERB_MODULE.values()):
        importlib.import_module(module_name).register(subparsers)
    registered = {action.dest: action.help for action in subparsers._choices_actions}
    assert registered == VERB_HELP


def test_an_unknown_verb_names_the_closest_one() -> None:
    typed = [sys.executable, "-m", "dflashops", "deplyo", "local"]
    out = subprocess.run(typed, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "error: 'deplyo' is not a dflashops verb\nhint: did you mean deploy? (`dflashops --help` lists the verbs)\n"
    )
    out = subprocess.run([*typed[:3], "frobnicate"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: 'frobnicate' is not a dflashops verb\nhint: ")
    assert "usage:" not in out.stderr
