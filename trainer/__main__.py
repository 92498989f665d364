"""`python -m trainer <verb> [flags]`: train | check | prepare | inspect | eval | export | demo | bench.

Each verb lives in its own module with a `main(argv: list[str]) -> int`, imported only when called, so
`python -m trainer prepare` never pays for the training stack and a broken optional module cannot break
`train`.
"""

from __future__ import annotations

import importlib
import os
import sys

VERBS = {
    "train": ("trainer.train", "train a DFlash drafter"),
    "check": ("trainer.check", "would `train` start with these flags? (code, flags, imports, pre-flight)"),
    "prepare": ("trainer.data.prepare", "tokenize / regenerate data into token shards"),
    "inspect": ("trainer.data.inspect", "show a prepared dataset"),
    "eval": ("trainer.evaluation.eval", "measure acceptance length with a target and a drafter"),
    "export": ("trainer.export.export", "write a checkpoint in the public DFlash format"),
    "demo": ("trainer.demo", "the tiny end-to-end demo"),
    "bench": ("trainer.bench.bench", "throughput benchmarks"),
}


# Verbs whose `--help` is printed by a light module's `build_parser()` instead of importing the verb's module.
HELP_PARSERS = {"train": "trainer.core.config"}


def usage() -> str:
    lines = ["usage: python -m trainer <verb> [flags]", "", "verbs:"]
    lines += [f"  {verb:<8} {about}" for verb, (_, about) in VERBS.items()]
    return "\n".join(lines)


def quiet_progress_bars() -> None:
    """No tqdm bars when stderr is not a terminal (a run's train.log, a pipe): transformers draws one per model
    load and save ("Loading weights", "Writing model shards"), each a run of carriage-return redraws that a log
    shows as one garbled line (issue 46 item 12). Environment, so it reaches the libraries however they import
    tqdm; a value the user set wins."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_progress_bars()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"error: unknown verb {verb!r}", file=sys.stderr)
        print(f"hint: one of {', '.join(VERBS)}", file=sys.stderr)
        return 2
    if verb in HELP_PARSERS and any(word in ("-h", "--help") for word in rest):
        # The help comes from the flags' own parser (no torch): trainer.train imports the training stack first,
        # seconds before a word of help.
        importlib.import_module(HELP_PARSERS[verb]).build_parser().print_help()
        return 0
    module_name = VERBS[verb][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"error: `{verb}` is not available in this build ({module_name} is missing)", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
