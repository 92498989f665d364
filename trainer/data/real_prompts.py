"""Prompts for the real-model world: offline, varied, with a held-out split by source (never by row).

Two sources every machine has:
- The Python standard library's own documentation: for each module of `STDLIB_MODULES`, its public functions and
  classes with a docstring give "explain what X does", "write an example that uses X" and "summarize this
  documentation: ..." prompts (kinds `code-explain`, `code-example`, `code-summarize`). The docstrings are the
  running Python's, so the texts differ a little between Python versions (the prompt file records the version).
- Instructions of other kinds written from templates here (`writing`, `reasoning`, `arithmetic`, `chat`), each
  template filled with topics, names and numbers drawn by a seeded generator.

Held-out prompts come from modules and templates that never appear in training: a module is held out when its
name hashes into the held-out share, and the last template of every kind is held out. So a held-out prompt asks
about code or in a phrasing the drafter never saw, as a user's prompts would.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Pure-Python modules that import quickly and without side effects, in a fixed order (no GUI, no network).
STDLIB_MODULES = [
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "http.cookies",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "os.path",
    "pathlib",
    "pickle",
    "pickletools",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "statistics",
    "string",
    "stringprep",
    "struct",
    "subprocess",
    "symtable",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
    "zipimport",
    "zlib",
]
HELD_OUT_MODULE_SHARE = 0.15

CODE_KINDS = ("code-explain", "code-example", "code-summarize")
CODE_TEMPLATES = {
    "code-explain": "Explain what `{name}` does in Python.",
    "code-example": "Write a short example that uses `{name}` from Python's standard library.",
    "code-summarize": "Summarize this documentation of `{name}` in two sentences:\n\n{doc}",
}

TOPICS = [
    "the ocean",
    "autumn leaves",
    "a quiet library",
    "city traffic",
    "a mountain village",
    "the first day of school",
    "a thunderstorm",
    "coffee",
    "a lost key",
    "the night sky",
    "a garden in spring",
    "an old bicycle",
    "a train journey",
    "snow",
    "a birthday party",
    "the desert",
    "a lighthouse",
    "friendship",
    "a rainy Monday",
    "the moon",
]
STYLES = ("cheerful", "sad", "formal", "funny", "calm", "mysterious", "simple", "vivid")
PEOPLE = ("my manager", "a colleague", "my landlord", "a teacher", "a friend", "my neighbour", "a customer")
SUBJECTS = [
    "a delayed project",
    "a team lunch",
    "a broken heater",
    "next week's meeting",
    "a late payment",
    "a new schedule",
    "a thank-you",
    "a change of address",
]
ITEMS = ("apples", "pencils", "notebooks", "tickets", "oranges", "books", "cups", "bottles")
ACTIVITIES = [
    "learn a new language",
    "sleep better",
    "save money",
    "start running",
    "cook more at home",
    "keep a plant alive",
    "focus while studying",
    "make new friends in a new city",
    "prepare for a job interview",
    "write every day",
]

# The last template of each kind is held out.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "writing": (
        "Write a short {style} poem about {topic}.",
        "Write a short {style} email to {person} about {subject}.",
        "Write a {c}-sentence {style} story about {topic}.",
        "Describe {topic} in one {style} paragraph for a child.",
    ),
    "reasoning": (
        "If {a} {item} cost {b} dollars, how much do {c} {item} cost? Explain your steps.",
        "Tom has {a} {item} and gives away {c}. How many are left? Explain.",
        "A train travels {a} kilometres in {c} hours. What is its average speed?",
        "Which is larger, {a} times {c} or {b}? Explain briefly.",
    ),
    "arithmetic": (
        "What is {a} + {b}?",
        "Compute {a} * {c}.",
        "What is {b} minus {a}?",
        "What is {a} divided by {c}, rounded to two decimals?",
    ),
    "chat": (
        "Give me {c} tips to {activity}.",
        "What is a good way to {activity} if I only have {c} minutes a day?",
        "I want to {activity} and I am {a} years old. Where should I start?",
        "Why is it hard to {activity}, and what helps? Answer in {c} sentences.",
    ),
}


@dataclass(frozen=True)
class Prompt:
    prompt: str
    kind: str
    source: str  # "module:NAME" or "template:KIND/INDEX": the unit of the held-out split

    def record(self) -> dict[str, str]:
        return {"prompt": self.prompt, "kind": self.kind, "source": self.source}


def held_out_module(name: str) -> bool:
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") / 2**32
    return bucket < HELD_OUT_MODULE_SHARE


def _first_paragraph(doc: str, limit: int = 600) -> str:
    text = inspect.cleandoc(doc).split("\n\n")[0].strip()
    return text[:limit]


def documented_names(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the module's public functions and classes that have a docstring, and of
    the public methods those classes define themselves."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    found = []
    for attr in sorted(getattr(module, "__all__", None) or dir(module)):
        if attr.startswith("_"):
            continue
        obj = getattr(module, attr, None)
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", module_name) not in (module_name, None) and not module_name.startswith(
            str(getattr(obj, "__module__", ""))
        ):
            continue  # re-exported from elsewhere: asked about where it is defined
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= 40:
            found.append((f"{module_name}.{attr}", _first_paragraph(doc)))
        if inspect.isclass(obj):
            for method_name, method in sorted(vars(obj).items()):
                method_doc = None if method_name.startswith("_") or not callable(method) else method.__doc__
                if method_doc and len(method_doc) >= 40:
                    found.append((f"{module_name}.{attr}.{method_name}", _first_paragraph(method_doc)))
    return found


def code_prompts() -> list[Prompt]:
    """Every documented name in every code kind, read in a fresh isolated interpreter (`python -I`, ~1 s).

    In this process the set would depend on what was imported before: transformers adds `warning_once`,
    `info_once` and `warning_advice` to `logging.Logger`, and torch replaces `inspect.getfile`. Measured
    2026-12-06: after those imports the held-out set had 2,322 prompts instead of 2,316, so the 48 held-out
    evaluation prompts of two runs of the same curve differed."""
    found = subprocess.run(
        [sys.executable, "-I", __file__, "--code-prompts"], capture_output=True, text=True, check=True
    )
    return [Prompt(**record) for record in json.loads(found.stdout)]


def _code_prompts_here() -> list[Prompt]:
    return [
        Prompt(CODE_TEMPLATES[kind].format(name=name, doc=doc), kind, f"module:{module_name}")
        for module_name in STDLIB_MODULES
        for name, doc in documented_names(module_name)
        for kind in CODE_KINDS
    ]


def template_prompts(rng: random.Random, per_template: int) -> list[Prompt]:
    prompts = []
    for kind, templates in TEMPLATES.items():
        for index, template in enumerate(templates):
            for _ in range(per_template):
                a, b, c = rng.randint(2, 99), rng.randint(100, 999), rng.randint(2, 12)
                text = template.format(
                    topic=rng.choice(TOPICS),
                    style=rng.choice(STYLES),
                    person=rng.choice(PEOPLE),
                    subject=rng.choice(SUBJECTS),
                    item=rng.choice(ITEMS),
                    activity=rng.choice(ACTIVITIES),
                    a=a,
                    b=b,
                    c=c,
                )
                prompts.append(Prompt(text, kind, f"template:{kind}/{index}"))
    return prompts


def is_held_out(prompt: Prompt) -> bool:
    origin, _, name = prompt.source.partition(":")
    if origin == "module":
        return held_out_module(name)
    if origin == "self":  # the target's own prompts (trainer/data/self_prompts.py) are training prompts only
        return False
    kind, _, index = name.partition("/")
    return int(index) == len(TEMPLATES[kind]) - 1


def build(seed: int = 0, per_template: int = 400) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts), each shuffled by `seed`; no duplicate texts; disjoint by source."""
    rng = random.Random(seed)
    everything = code_prompts() + template_prompts(rng, per_template)
    unique = list({p.prompt: p for p in everything}.values())
    train = [p for p in unique if not is_held_out(p)]
    held = [p for p in unique if is_held_out(p)]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def stratified(prompts: list[Prompt], count: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts keeping the code/other mix of the whole list (round-robin over kinds, shuffled)."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    order = sorted(by_kind)
    picked: list[Prompt] = []
    while len(picked) < min(count, len(prompts)):
        for kind in order:
            if by_kind[kind] and len(picked) < count:
                picked.append(by_kind[kind].pop(0))
    random.Random(seed).shuffle(picked)
    return picked


def composition(prompts: list[Prompt]) -> dict[str, object]:
    kinds = Counter(p.kind for p in prompts)
    code = sum(kinds[k] for k in CODE_KINDS)
    return {
        "prompts": len(prompts),
        "kinds": dict(sorted(kinds.items())),
        "code_share": round(code / max(len(prompts), 1), 3),
        "sources": len({p.source for p in prompts}),
        "python": sys.version.split()[0],
    }


def write_jsonl(path: Path, prompts: list[Prompt]) -> Path:
    path.write_text("".join(json.dumps(p.record()) + "\n" for p in prompts))
    return path


if __name__ == "__main__" and sys.argv[1:] == ["--code-prompts"]:  # code_prompts()'s isolated reader
    json.dump([p.record() for p in _code_prompts_here()], sys.stdout)
