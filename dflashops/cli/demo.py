"""`python -m dflashops.cli.demo` (what `make demo` runs): the tiny DFlash loop, deployed through dflashops.

Deploys the inventory's `demo` profile (`python -m trainer demo`: build a tiny target, prepare data,
train a drafter, evaluate acceptance length) onto the `local` target, follows its log until the run
finishes, and prints where everything is. Exit 0 only when the run finished with exit code 0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dflashops.cli.common import open_invocation, print_error, progress
from dflashops.core.errors import DflashopsError
from dflashops.ops.runs.control import DEFAULT_FAIL_ON, run_status, wait_for
from dflashops.ops.runs.deploy import deploy
from dflashops.ops.runs.launch import DeployRequest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflashops.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", help="inventory.yaml (default: the repository's)")
    parser.add_argument(
        "--world",
        choices=("synthetic", "real"),
        default="synthetic",
        help="synthetic: the tiny walk-grammar target (the `demo` profile); real: SmolLM2-135M-Instruct (the "
        "`demo-real` profile, make demo-real) (default: synthetic)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="profile to run (default: demo, or demo-real with --world real; `tiny` trains only)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before giving up (default 1800, 7200 with --world real)"
    )
    parser.add_argument(
        "--arch",
        choices=("dflash", "dflash2", "both"),
        default="dflash",
        help="demo profile only: the drafter architecture; both trains DFlash and DFlash2 on the same data and "
        "steps and prints both tables (make demo DEMO_ARCH=both) (default: dflash)",
    )
    args = parser.parse_args(argv)
    args.profile = args.profile or ("demo-real" if args.world == "real" else "demo")
    args.timeout = args.timeout or (7200.0 if args.world == "real" else 1800.0)
    extra = ["--arch", args.arch] if args.arch != "dflash" else []
    name = time.strftime(f"{args.profile}-%Y%m%d-%H%M%S", time.gmtime())
    try:
        with open_invocation(args) as invocation:
            outcome = deploy(
                invocation,
                DeployRequest(
                    target="local",
                    profile=args.profile,
                    name=name,
                    launcher="nohup",
                    note="make demo-real" if args.world == "real" else "make demo",
                    extra_args=extra,
                ),
            )
            progress(f"launched {outcome.name} in {outcome.run_dir}; following its log")
            wait_for(
                invocation,
                outcome.name,
                until=None,
                fail_on=DEFAULT_FAIL_ON,
                timeout=args.timeout,
                on_text=lambda text: sys.stderr.write(text),
                observe=True,  # the run's end into its lineage record, which `runs tree` (the next step) shows
            )
            final = run_status(invocation, outcome.name)[0]
    except DflashopsError as exc:
        print_error(exc)
        return exc.exit_code
    print(f"{outcome.name}: {final['state']} (exit code {final['exit_code']}) in {outcome.run_dir}")
    command, activate = dflashops_command()
    print(f"next: {command} runs tree; {command} logs {outcome.name}; {command} restart {outcome.name} --name +")
    if activate:
        print(f"(or `source {activate}` first, then plain `dflashops`)")
    return 0 if final["state"] == "finished" else 1


def dflashops_command() -> tuple[str, str | None]:
    """How to type `dflashops` from here: the word itself when it is on PATH, else the script beside this
    Python (`.venv/bin/dflashops` after `make demo`: the Makefile never activates the virtual environment), with
    the activate script that puts it on PATH."""
    script = Path(sys.executable).parent / "dflashops"
    found = shutil.which("dflashops")
    if not script.is_file() or (found is not None and Path(found).resolve() == script.resolve()):
        return "dflashops", None
    try:
        shown = script.relative_to(Path.cwd())
    except ValueError:
        shown = script
    activate = shown.parent / "activate"
    return str(shown), str(activate) if (script.parent / "activate").is_file() else None


if __name__ == "__main__":
    sys.exit(main())
