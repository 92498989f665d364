"""`python -m trainer <verb> --help` (issue 15, item 19): every flag says what it does, its default and its choices."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.core.config import LOSS_KERNELS, PRESETS, build_parser

REPO = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(r"^  (\S.*?)(?: {2,}(\S.*))?$")  # "  --flag METAVAR   help..." (help may start below)
_MORE = re.compile(r"^ {6,}(\S.*)$")  # a wrapped help line


def _help(verb: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "trainer", verb, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _option_help(text: str) -> dict[str, tuple[str, str]]:
    """Every entry of argparse's option sections -> (its invocation, e.g. '--preset {tiny,...}', its help text
    with wrapped lines joined), keyed by each of its option strings ('-h', '--help', '--max-steps', ...)."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current: list[str] | None = None
    for line in text.split("\n\n", 1)[1].splitlines():  # past the usage block
        entry, more = _ENTRY.match(line), _MORE.match(line)
        if entry:
            current = [entry.group(2) or ""]
            names = re.findall(r"(?:^|, )(-{1,2}[\w-]+)", entry.group(1)) or [entry.group(1)]  # or a positional
            for option in names:
                entries[option] = (entry.group(1), current)
        elif more and current is not None:
            current.append(more.group(1))
        else:
            current = None
    return {
        option: (invocation, " ".join(part for part in parts if part))
        for option, (invocation, parts) in entries.items()
    }


def test_item19_train_help_every_flag_has_help_with_its_default_and_choices() -> None:
    entries = _option_help(_help("train"))
    helps = {option: text for option, (_, text) in entries.items()}
    options = [o for action in build_parser()._actions for o in action.option_strings]
    assert len(options) > 60
    missing = [o for o in options if not helps.get(o)]
    assert not missing, f"flags without help: {missing}"
    no_default = [o for o in options if o not in ("-h", "--help") and "default:" not in helps[o]]
    assert not no_default, f"flags whose help shows no default: {no_default}"
    assert entries["--preset"][0] == "--preset {" + ",".join(PRESETS) + "}"  # the choices
    assert entries["--loss-kernels"][0] == "--loss-kernels {" + ",".join(LOSS_KERNELS) + "}"
    assert all(kind in helps["--loss-kernels"] for kind in LOSS_KERNELS)  # and what each one is
    assert entries["--wandb"][0] == "--wandb {auto,on,off}" and entries["--sync"][0] == "--sync {grad,average}"
    assert "a cap" in helps["--max-steps"] and "at most" in helps["--max-steps"]
    assert "--preset tiny 0.003" in helps["--lr"]  # a preset's own default is shown beside the plain one


def test_item19_train_flags_with_a_fixed_set_refuse_other_values_naming_the_choices() -> None:
    from trainer.core.config import TrainerInputError, parse_train_args

    for flag, bad in (
        ("--loss-kernels", "turbo"),
        ("--wandb", "maybe"),
        ("--sync", "sometimes"),
        ("--feature-transfer", "pigeon"),
        ("--noise-type", "pink"),
        ("--preset", "huge"),
    ):
        with pytest.raises(TrainerInputError) as info:
            parse_train_args(["--preset", "tiny", flag, bad])
        assert flag in info.value.message and "choose from" in info.value.message, info.value.message


# Flags a verb requires (no default to show). `export` is not listed below: its two arguments, both required,
# already had help.
REQUIRED = {
    "prepare": {"--target-model", "--input", "--output-dir"},
    "inspect": set(),
    "eval": {"--target-model", "--drafter", "--prompts"},
    "demo": {"--workdir"},
    "bench": set(),
}


@pytest.mark.parametrize("verb", sorted(REQUIRED))
def test_item19_every_other_verb_argument_has_help_and_each_optional_flag_its_default(verb: str) -> None:
    entries = _option_help(_help(verb))
    assert len(entries) >= 3, entries
    missing = [o for o, (_, text) in entries.items() if not text]
    assert not missing, f"{verb}: arguments without help: {missing}"
    optional = [o for o in entries if o.startswith("--") and o != "--help" and o not in REQUIRED[verb]]
    no_default = [o for o in optional if "default" not in entries[o][1]]
    assert not no_default, f"{verb}: flags whose help shows no default: {no_default}"
