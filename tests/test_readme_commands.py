"""Every command line in the code blocks of README.md and of every docs/*.md page parses with the shipped CLIs'
own argparse parsers (issue 15, item 20; the docs pages since the README's reference moved there, issue 30
item 5). Nothing is executed: only argparse runs.

Extraction, kept simple on purpose:
- Only fenced code blocks (```) are read. A command starts with `dflashops ` or `python -m trainer `, at the
  start of a line or after three or more spaces (one line may show several commands side by side).
- A `#` after whitespace starts a comment. An indented line right after a command line continues that
  command (after its comment is cut off, so an indented `# ...` line continues only the comment).
- A spaced arrow ` -> ` ends a command: what follows is a diagram's (docs/architecture.md draws the trainer's
  structure from `python -m trainer train ->`), not the command's.

Expansion of the usage notation into concrete command lines:
- `[ ... ]` is an optional part; `A|B` offers alternatives for one word (`A | B`, spaced, too).
- A bare `...` is a value placeholder (replaced by `x`); an optional part holding a word that ends in `...`
  (`[seed-run flags...]`) is prose, never filled in. Metavariables that must be numbers: `S` -> 60, `N` -> 0.
- Variants: for k = 0 .. K-1 (K: the most alternatives any word offers), take alternative min(k, n-1) of
  every word, once with every optional part filled in and once with none.

Parsing: `dflashops ...` through dflashops.cli.main.parse_command_line (what main() runs, `--` cut included).
`python -m trainer train ...` through trainer.core.config.build_parser (the parser parse_train_args uses) and
the check that a named preset exists (the config's own checks, such as a target model for the big presets,
are not argparse's and not made here); other trainer verbs through trainer's own dispatcher with
argparse.ArgumentParser.parse_args wrapped to stop right after a successful parse, so each verb's real
parser runs and its body never does. Target, profile and host names written in lower case must exist in the
shipped inventory.yaml (or inventory.example.yaml, the Proxmox example the README points to); playbook
paths must exist.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
ARROW = re.compile(r"\s->\s")
COMMAND_START = re.compile(r"(?:^|(?<=\s{3}))(?=dflashops |python -m trainer )")
NUMBERS = {"S": "60", "N": "0"}


# ------------------------------------------------------------------------------------------ extraction
def code_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def strip_comment(line: str) -> str:
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0].rstrip()


def command_lines(text: str) -> list[str]:
    commands: list[str] = []
    for block in code_blocks(text):
        continuing = False
        for raw in block:
            line = strip_comment(raw)
            starts = [m.start() for m in COMMAND_START.finditer(line)]
            if line[:1].isspace() and continuing and (not starts or starts[0] > 0):
                commands[-1] += " " + line.strip()  # a wrapped usage line
                continue
            continuing = bool(starts) and not line[:1].isspace()
            if not continuing:
                continue
            for begin, end in zip(starts, [*starts[1:], len(line)]):
                commands.append(line[begin:end].strip())
    return [ARROW.split(command, maxsplit=1)[0].strip() for command in commands]


# ------------------------------------------------------------------------------------------- expansion
def tokenize(command: str) -> list[object]:
    """`[`, `]` and words; a word is the list of its `|` alternatives. Quotes group (and are removed)."""
    tokens: list[object] = []
    alternatives: list[str] = []
    current, quote, in_word, join = "", None, False, False

    def flush() -> None:
        nonlocal current, alternatives, in_word, join
        if in_word:
            if join and tokens and isinstance(tokens[-1], list):
                tokens[-1] += [*alternatives, current]  # `A | B`: one word with two alternatives
            else:
                tokens.append([*alternatives, current])
            join = False
        current, alternatives, in_word = "", [], False

    for char in command:
        if quote:
            if char == quote:
                quote = None
            else:
                current += char
        elif char in "\"'":
            quote, in_word = char, True
        elif char.isspace():
            flush()
        elif char in "[]":
            flush()
            tokens.append(char)
        elif char == "|" and not in_word:
            join = True
        elif char == "|":
            alternatives.append(current)
            current = ""
        else:
            current += char
            in_word = True
    assert quote is None, f"unbalanced quote in {command!r}"
    flush()
    return tokens


def tree(tokens: list[object]) -> list[object]:
    """Nested lists: a word stays a list of strings, an optional part becomes ("opt", [...])."""
    stack: list[list[object]] = [[]]
    for token in tokens:
        if token == "[":
            stack.append([])
        elif token == "]":
            inner = stack.pop()
            stack[-1].append(("opt", inner))
        else:
            stack[-1].append(token)
    assert len(stack) == 1, "unbalanced brackets"
    return stack[0]


def words_of(node: list[object]) -> list[list[str]]:
    out: list[list[str]] = []
    for item in node:
        out += words_of(item[1]) if isinstance(item, tuple) else [item]
    return out


def expand(node: list[object], k: int, fill: bool) -> list[str]:
    out: list[str] = []
    for item in node:
        if isinstance(item, tuple):
            prose = any(alt.endswith("...") and alt != "..." for word in words_of(item[1]) for alt in word)
            if fill and not prose:
                out += expand(item[1], k, fill)
        else:
            word = item[min(k, len(item) - 1)]
            out.append("x" if word == "..." else NUMBERS.get(word, word))
    return out


def variants(command: str) -> list[list[str]]:
    node = tree(tokenize(command))
    most = max((len(word) for word in words_of(node)), default=1)
    found: list[list[str]] = []
    for fill in (True, False):
        for k in range(most):
            argv = expand(node, k, fill)
            if argv not in found:
                found.append(argv)
    return found


# --------------------------------------------------------------------------------------------- parsing
class Parsed(Exception):
    """Raised by the wrapped parse_args once a trainer verb's parser accepted its arguments."""


def parse_errors(argv: list[str], known: dict[str, set[str]]) -> str | None:
    """None when `argv` parses, else what went wrong (argparse's words, or the unknown name)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "dflashops":
                return check_dflashops(argv[1:], known)
            return check_trainer(argv[3:])
    except SystemExit as exc:
        return f"exit {exc.code}: {stderr.getvalue().strip()}"
    except Exception as exc:  # noqa: BLE001 - DflashopsError/TrainerInputError: the parse was refused
        return f"{type(exc).__name__}: {exc}"


def check_dflashops(words: list[str], known: dict[str, set[str]]) -> str | None:
    from dflashops.cli.main import parse_command_line

    _, args = parse_command_line(words)
    if getattr(args, "func", None) is None:
        return "no verb"
    names = [
        ("target", getattr(args, "target", None)),
        ("profile", getattr(args, "profile", None)),
        ("host", getattr(args, "host", None)),
        *(("target", t) for t in getattr(args, "targets", []) or []),
    ]
    for kind, name in names:
        if isinstance(name, str) and name.islower() and name not in known[kind]:
            return f"{kind} {name!r} is in neither inventory.yaml nor inventory.example.yaml"
    playbook = getattr(args, "playbook", None)
    if playbook and not (REPO / playbook).is_file():
        return f"playbook {playbook} does not exist"
    return None


def check_trainer(words: list[str]) -> str | None:
    if words[0] == "train":
        from trainer.core.config import PRESETS, build_parser

        preset = getattr(build_parser().parse_args(words[1:]), "preset", None)
        return None if preset is None or preset in PRESETS else f"unknown preset {preset!r}"
    import trainer.__main__ as trainer_main

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> object:
        original(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    try:
        code = trainer_main.main(words)
    except Parsed:
        return None
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return f"the verb returned {code} before parsing its arguments"


def known_names() -> dict[str, set[str]]:
    from dflashops.core.inventory import load_inventory

    known: dict[str, set[str]] = {"target": set(), "profile": set(), "host": set()}
    for name in ("inventory.yaml", "inventory.example.yaml"):
        if (REPO / name).is_file():
            inventory = load_inventory(REPO / name)
            known["target"] |= set(inventory.targets)
            known["profile"] |= set(inventory.profiles)
            known["host"] |= set(inventory.hosts) | set(inventory.targets)
    return known


# ----------------------------------------------------------------------------------------------- tests
BAD_LINES = (
    ["dflashops", "runs", "export", "--jsn"],
    ["dflashops", "stop", "--bogus"],
    ["dflashops", "deploy", "--profile", "nope"],
    ["dflashops", "logs"],
    ["python", "-m", "trainer", "bench", "nothing"],
    ["python", "-m", "trainer", "train", "--preset", "huge"],
)


def check_the_checker(known: dict[str, set[str]]) -> None:
    """The extractor and the checker themselves, on made-up input: a checker that parses nothing, or
    accepts anything, would pass on any README."""
    text = (
        "```\ndflashops a [--x X|+] [--y]   dflashops b (prose)  # note\n"
        "              [--z 1] [-- t args]\nmake demo\n   dflashops c\n"
        "python -m trainer t --p a|b [more flags...]   # one\n      # two\n"
        "python -m trainer d  ->  a/b.py   a box\n                    ->  c.py\n```\n"
    )
    assert command_lines(text) == [
        "dflashops a [--x X|+] [--y]",
        "dflashops b (prose) [--z 1] [-- t args]",
        "python -m trainer t --p a|b [more flags...]",
        "python -m trainer d",
    ]
    assert variants("dflashops a [--x X|+] [--note ...] [--t S]") == [
        ["dflashops", "a", "--x", "X", "--note", "x", "--t", "60"],
        ["dflashops", "a", "--x", "+", "--note", "x", "--t", "60"],
        ["dflashops", "a"],
    ]
    assert variants('p -m t x --w "step 10/" [seed flags...]') == [["p", "-m", "t", "x", "--w", "step 10/"]]
    assert variants("dflashops s RUN | --all [--g 1]") == [
        ["dflashops", "s", "RUN", "--g", "1"],
        ["dflashops", "s", "--all", "--g", "1"],
        ["dflashops", "s", "RUN"],
        ["dflashops", "s", "--all"],
    ]
    for argv in BAD_LINES:
        assert parse_errors(argv, known) is not None, argv
    assert parse_errors(["dflashops", "logs", "r1", "-f"], known) is None
    assert parse_errors(["python", "-m", "trainer", "export", "ckpt", "--output", "d"], known) is None


def refused(page: Path, known: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """The command lines of `page` and, for each variant the CLI refuses, what went wrong."""
    commands = command_lines(page.read_text(encoding="utf-8"))
    failures = []
    for command in commands:
        for argv in variants(command):
            error = parse_errors(argv, known)
            if error:
                failures.append(f"{' '.join(argv)}\n    (from {page.relative_to(REPO)}: {command})\n    {error}")
    return commands, failures


def counts(commands: list[str]) -> tuple[int, int]:
    return sum(c.startswith("dflashops ") for c in commands), sum(c.startswith("python -m trainer ") for c in commands)


def test_item20_every_readme_command_line_parses() -> None:
    known = known_names()
    check_the_checker(known)
    commands, failures = refused(README, known)
    dflashops, trainer = counts(commands)
    assert dflashops >= 10 and trainer >= 2, commands  # the quickstart, the daily loop, targets, the trainer
    assert not failures, "README command lines the CLI refuses:\n" + "\n".join(failures)


def test_every_docs_command_line_parses() -> None:
    """The same check over every page of docs/, where the verbs' and the trainer's reference lives."""
    known = known_names()
    check_the_checker(known)
    commands, failures = [], []
    for page in sorted(DOCS.glob("*.md")):
        found, refusals = refused(page, known)
        commands += found
        failures += refusals
    dflashops, trainer = counts(commands)
    assert dflashops >= 30 and trainer >= 7, commands  # docs/cli.md alone shows every verb
    assert not failures, "docs/ command lines the CLI refuses:\n" + "\n".join(failures)
