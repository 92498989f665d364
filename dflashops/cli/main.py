"""`dflashops` entry point: builds the argparse tree from the verb modules and maps errors to exit codes.

Each verb group is a module with `register(subparsers) -> None`; its parsers `set_defaults(func=handler)`
with `handler(args) -> int`. This is the only place that turns a DflashopsError into `error: ...` /
`hint: ...` on stderr and its exit code. Modules owned by other teams (runs, trust) are imported guarded,
so a missing one removes its verb instead of breaking the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from dflashops.core.errors import DflashopsError, UsageError

VERB_MODULES = (
    "dflashops.cli.deploy",
    "dflashops.cli.control",
    "dflashops.cli.runs",
    "dflashops.cli.trust",
    "dflashops.cli.play",
    "dflashops.cli.watch",
    "dflashops.cli.doctor",
    "dflashops.cli.fetch",
    "dflashops.cli.provision",
)
OPTIONAL_MODULES = {
    "dflashops.cli.runs",
    "dflashops.cli.trust",
    "dflashops.cli.play",
    "dflashops.cli.watch",
    "dflashops.cli.doctor",
    "dflashops.cli.fetch",
    "dflashops.cli.provision",
}
# The module that registers each verb. When the command line names one of these, only that module is
# imported: start-up is part of every scripted restart's wall time, and rich, the playbook engine and the
# lineage views cost ~80 ms of imports that `restart`/`deploy` never use. Anything else (no verb,
# --help) lists every verb from VERB_HELP; an unknown word is an error naming the closest verb (unknown_verb).
VERB_MODULE = {
    "deploy": "dflashops.cli.deploy",
    "restart": "dflashops.cli.deploy",
    **{verb: "dflashops.cli.control" for verb in ("stop", "status", "logs", "exec", "attach", "gc")},
    "runs": "dflashops.cli.runs",
    "trust": "dflashops.cli.trust",
    "play": "dflashops.cli.play",
    "watch": "dflashops.cli.watch",
    "doctor": "dflashops.cli.doctor",
    "fetch": "dflashops.cli.fetch",
    "provision": "dflashops.cli.provision",
}

# Each verb's one-line help, as its module registers it, for the top-level `dflashops --help`: that page
# names every verb, and importing every verb module to build it cost ~0.13 s of a ~0.19 s call (issue 46 item 7,
# bench/cli_startup.py). tests/controller/test_cli_startup.py checks these against the modules' own. A verb
# missing here is still listed: its module is imported for it.
VERB_HELP = {
    "deploy": "sync the code and launch a run",
    "restart": "stop a run and relaunch it as a new child run",
    "stop": "stop a run: SIGTERM its process group, grace, SIGKILL, wait",
    "status": "state of one run or of every run on a target",
    "logs": "print or follow a run's train.log",
    "exec": "run a command on a target: dflashops exec TARGET -- argv",
    "attach": "attach to a run's tmux session (for humans)",
    "gc": "delete old releases and (only when named) finished run directories",
    "runs": "run lineage: list, tree, show, diff, sync, plot, export",
    "trust": "record a host's SSH key after showing its fingerprint",
    "play": "run a playbook: ordered dflashops steps from a YAML file",
    "watch": "live view of a run (or --all runs of a target); q quits",
    "doctor": "check that a target can run: host, container, GPUs, python, torch, disk, clock",
    "fetch": "bring a run's checkpoint, export or logs here: resumable, sha256-verified, atomic",
    "provision": "create or finish a target's Proxmox GPU container (planned with --dry-run)",
}


def verb_index(words: Sequence[str]) -> int | None:
    """Where the verb word of a command line is (skipping the top-level `--inventory PATH`), or None."""
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--inventory":
            index += 2
            continue
        if word.startswith("--inventory="):
            index += 1
            continue
        return None if word.startswith("-") else index
    return None


def verb_of(words: Sequence[str]) -> str | None:
    """The verb word of a command line (skipping the top-level `--inventory PATH`), or None."""
    index = verb_index(words)
    return None if index is None else words[index]


def package_version(distribution: str = "dflashops") -> str:
    """The installed distribution's version; in a source tree that was never installed, pyproject.toml's."""
    import importlib.metadata  # here, not at the top: only `--version` pays for it

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M)
        except OSError:
            found = None
        return found.group(1) if found else "unknown"


class VersionAction(argparse.Action):
    """`--version`: like argparse's own, but the version is only looked up when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the dflashops version and exit"
        )

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: object, values: object, option_string: str | None = None
    ) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflashops",
        description="Deploy, restart, stop and watch DFlash training runs on local and Proxmox targets.",
    )
    parser.add_argument(
        "--inventory",
        metavar="PATH",
        help="inventory.yaml to use (default: $DFLASHOPS_INVENTORY, ./inventory.yaml or a parent's)",
    )
    parser.add_argument("--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    if verb is None:  # `dflashops`, `dflashops --help`: the verbs' names and help lines, no verb module imported
        unlisted = [name for name in VERB_MODULE if name not in VERB_HELP]
        for module_name in dict.fromkeys(VERB_MODULE[name] for name in unlisted):
            importlib.import_module(module_name).register(subparsers)
        for name, text in VERB_HELP.items():
            if name not in subparsers.choices:
                subparsers.add_parser(name, help=text)
        return parser
    for module_name in [VERB_MODULE[verb]] if verb in VERB_MODULE else VERB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if module_name in OPTIONAL_MODULES and exc.name == module_name:
                continue
            raise
        module.register(subparsers)
    return parser


def unknown_verb(word: str) -> UsageError:
    """`dflashops deplyo`: one error line and the closest verb, not argparse's usage and list of every choice."""
    import difflib

    close = difflib.get_close_matches(word, list(VERB_MODULE), n=1, cutoff=0.6)
    listing = "`dflashops --help` lists the verbs"
    return UsageError(
        f"{word!r} is not a dflashops verb",
        hint=f"did you mean {close[0]}? ({listing})" if close else listing,
    )


def parse_command_line(words: Sequence[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed arguments of one command line, exactly as main() sees them; runs nothing.
    Everything after the first `--` is passed through untouched as `args.passthrough` (extra trainer args,
    exec's argv). Bad arguments exit through argparse (SystemExit 2), or raise the UsageError of a verb's
    `misplaced_words(args, words from the verb on, words argparse did not take)`."""
    words = list(words)
    verb = verb_of(words)
    if verb is not None and verb not in VERB_MODULE:
        raise unknown_verb(verb)
    parser = build_parser(verb)
    passthrough: list[str] = []
    if "--" in words:
        cut = words.index("--")
        words, passthrough = words[:cut], words[cut + 1 :]
    args, extra = parser.parse_known_args(words)
    args.passthrough = passthrough
    if extra:
        # A verb may explain words it cannot take (exec: the command came without `--`): a UsageError.
        misplaced = getattr(args, "misplaced_words", None)
        if misplaced is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        raise misplaced(args, words[verb_index(words) or 0 :], extra)
    return parser, args


def inventory_notice(args: argparse.Namespace) -> str | None:
    """`using inventory ...` when the inventory was neither named (--inventory, $DFLASHOPS_INVENTORY) nor found in
    the current folder: a command typed in another folder would otherwise act on a parent's inventory, or the
    package's own, without a word. None for `runs ... --db PATH`, which reads no inventory."""
    if args.inventory or os.environ.get("DFLASHOPS_INVENTORY") or getattr(args, "db", None):
        return None
    from dflashops.core.inventory import find_inventory

    path = find_inventory(None)
    if path.parent == Path.cwd():
        return None
    return f"using inventory {path} (there is no inventory.yaml in {Path.cwd()}; --inventory PATH names another)"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser, args = parse_command_line(sys.argv[1:] if argv is None else argv)
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return 2
        if notice := inventory_notice(args):
            print(notice, file=sys.stderr)
        return int(args.func(args) or 0)
    except DflashopsError as exc:
        from dflashops.cli.common import print_error

        print_error(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
