"""A tiny, safe expression language for playbook conditions (`step >= 50`, `block_tok_s > 5000`).

Grammar (no eval, no attribute access, no calls):

    expr    := and ('or' and)*
    and     := not ('and' not)*
    not     := 'not' not | compare
    compare := operand (('<' | '<=' | '>' | '>=' | '==' | '!=') operand)?
    operand := NUMBER | STRING | NAME | '(' expr ')'
    NAME    := identifier ('.' identifier | '[' INT ']')*      e.g. queues.t0.depth, block_tok_s_per_drafter[1]

`parse(text)` returns a Condition whose `evaluate(values)` looks names up in a metrics mapping. A name that
is not in the mapping raises MissingMetric (a wait keeps waiting; an assert fails and says which name).
Comparing a number with a string is False for `==`/`<` alike, never an exception.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<number>-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)
  | (?P<string>"[^"]*"|'[^']*')
  | (?P<op><=|>=|==|!=|<|>|\(|\))
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)
)""",
    re.VERBOSE,
)
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
_KEYWORDS = {"and", "or", "not"}


class ExprSyntaxError(ValueError):
    """The condition text does not parse; the message names the position."""


class MissingMetric(KeyError):
    """A name in the condition has no value (yet) in the metrics."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def lookup(values: Mapping[str, Any], path: str) -> Any:
    """`queues.t0.depth` / `block_tok_s_per_drafter[1]` in nested dicts and lists; MissingMetric if absent."""
    current: Any = values
    for part in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\[\d+\]", path):
        try:
            current = current[int(part[1:-1])] if part.startswith("[") else current[part]
        except (KeyError, IndexError, TypeError):
            raise MissingMetric(path) from None
    if current is None:
        raise MissingMetric(path)
    return current


@dataclass(frozen=True)
class Condition:
    text: str
    _node: tuple

    def names(self) -> list[str]:
        """Every metric name the condition reads, in order of appearance."""
        found: list[str] = []

        def walk(node: tuple) -> None:
            if node[0] == "name":
                found.append(node[1])
            for child in node[1:]:
                if isinstance(child, tuple):
                    walk(child)

        walk(self._node)
        return found

    def evaluate(self, values: Mapping[str, Any]) -> bool:
        return bool(_eval(self._node, values))


def _eval(node: tuple, values: Mapping[str, Any]) -> Any:
    kind = node[0]
    if kind == "const":
        return node[1]
    if kind == "name":
        return lookup(values, node[1])
    if kind == "not":
        return not _eval(node[1], values)
    if kind == "and":
        return _eval(node[1], values) and _eval(node[2], values)
    if kind == "or":
        return _eval(node[1], values) or _eval(node[2], values)
    left, right = _eval(node[2], values), _eval(node[3], values)
    if isinstance(left, str) != isinstance(right, str):
        return node[1] == "!="  # a number never equals or orders against a word
    return _COMPARE[node[1]](left, right)


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            bad = text[pos:].lstrip()
            raise ExprSyntaxError(f"unexpected {bad[:1]!r} at column {len(text) - len(bad) + 1} in {text!r}")
        kind = match.lastgroup or ""
        value, column = match.group(kind), match.start(kind) + 1
        if kind == "name" and value in _KEYWORDS:
            kind = "keyword"
        tokens.append((kind, value, column))
        pos = match.end()
    return tokens


def parse(text: str) -> Condition:
    """Parse a condition; ExprSyntaxError naming the column when it is not one."""
    tokens = _tokenize(text)
    position = 0

    def peek() -> tuple[str, str, int] | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> tuple[str, str, int]:
        nonlocal position
        token = peek()
        if token is None:
            raise ExprSyntaxError(f"condition {text!r} ends too early")
        position += 1
        return token

    def binary(word: str, inner: Callable[[], tuple]) -> tuple:
        node = inner()
        while (token := peek()) is not None and token[:2] == ("keyword", word):
            take()
            node = (word, node, inner())
        return node

    def expr() -> tuple:
        return binary("or", lambda: binary("and", negation))

    def negation() -> tuple:
        token = peek()
        if token is not None and token[:2] == ("keyword", "not"):
            take()
            return ("not", negation())
        return compare()

    def compare() -> tuple:
        left = operand()
        token = peek()
        if token is not None and token[0] == "op" and token[1] in _COMPARE:
            take()
            return ("cmp", token[1], left, operand())
        return left

    def operand() -> tuple:
        kind, value, column = take()
        if kind == "number":
            return ("const", float(value) if any(c in value for c in ".eE") else int(value))
        if kind == "string":
            return ("const", value[1:-1])
        if kind == "name":
            return ("name", value)
        if (kind, value) == ("op", "("):
            node = expr()
            closing = take()
            if closing[:2] != ("op", ")"):
                raise ExprSyntaxError(f"expected ')' at column {closing[2]} in {text!r}")
            return node
        raise ExprSyntaxError(f"unexpected {value!r} at column {column} in {text!r}")

    if not tokens:
        raise ExprSyntaxError("empty condition")
    node = expr()
    if (extra := peek()) is not None:
        raise ExprSyntaxError(f"unexpected {extra[1]!r} at column {extra[2]} in {text!r}")
    return Condition(text, node)
