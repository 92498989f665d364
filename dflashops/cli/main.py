"""`dflashops` entry point: builds the argparse tree from the verb modules and maps errors to exit codes.

Each verb group is a module with `register(subparsers) -> None`; its parsers `set_defaults(func=handler)`
with `handler(args) -> int`. This is the only place that turns a DflashopsError into `error: ...` /
`hint: ...` on stderr and its exit code. Modules owned by other teams (runs, trust) are imported guarded,
so a missing one removes its verb instead of breaking the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dflashops.errors import DflashopsError

VERB_MODULES = ("dflashops.cli.deploy", "dflashops.cli.control", "dflashops.cli.runs", "dflashops.cli.trust",
                "dflashops.cli.play", "dflashops.cli.watch")
OPTIONAL_MODULES = {"dflashops.cli.runs", "dflashops.cli.trust", "dflashops.cli.play", "dflashops.cli.watch"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflashops",
        description="Deploy, restart, stop and watch DFlash training runs on local and Proxmox targets.",
    )
    parser.add_argument("--inventory", metavar="PATH",
                        help="inventory.yaml to use (default: $DFLASHOPS_INVENTORY, ./inventory.yaml or a parent's)")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    for module_name in VERB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if module_name in OPTIONAL_MODULES and exc.name == module_name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is passed through untouched (extra trainer args, exec's argv).
    passthrough: list[str] = []
    if "--" in words:
        cut = words.index("--")
        words, passthrough = words[:cut], words[cut + 1 :]
    args = parser.parse_args(words)
    args.passthrough = passthrough
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except DflashopsError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
