"""Playbooks: YAML files of ordered dflashops steps, loaded and validated before anything runs.

    description: what the playbook does
    vars:                      # defaults; `null` = required, give it with --set NAME=VALUE
      run: null
      steps: 10
    steps:
      - name: stop the old run cleanly          # optional label for the report
        stop: {run: "{{run}}", grace: 60}       # exactly one step kind per item (see STEP_KINDS)
        on_failure: stop                        # stop (default) | continue | restart-with-resume
        register: stopped                       # later steps may use {{stopped.exit_code}}
      - include: {file: common.yaml, vars: {x: 1}}   # splice another playbook's steps (relative path)
      - loop: {items: "{{grid}}", as: point, steps: [...]}

Step kinds (arguments; * = required): stop {run*, target, grace} | sync {run, profile, target} |
clear-cache {run, profile, target} | deploy {profile, name, parent, note, launcher, clear_cache, extra_args,
target} (with a parent: its profile, launcher, extra args and target, and name `+`) | restart {run*, name,
note, resume, clear_cache, extra_args, grace, launcher, unchecked} | wait {run*, timeout*, log REGEX | metric CONDITION,
fail_on (default: Traceback), poll, target} | assert {that* CONDITION, run, message, target} |
exec {argv* [words], check, target} | collect {run*, into* TABLE, fields, target} | loop | include.
A restart step whose old run is alive and whose job cannot be checked (not the trainer, no profile `check:`) fails
as `restart` does unless it says `unchecked: true`; `on_failure: restart-with-resume` revives a run its step
judged failed, as a supervisor does, and stops it unchecked. Built-in variables: `target` (play --target) and `latest_run` (the newest running run on that target).

`{{name}}` / `{{name.field}}` / `{{name.list[0]}}` substitute variables; a value that is exactly one
`{{...}}` keeps its type (a list stays a list). Every problem found here is a PlaybookError naming the file
and line: unknown step kind or key, a missing variable, a reference to an unknown name, a wait without a
timeout, a bad condition or regex, a cycle in includes. The runner is in playbook/runner.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflashops.core.errors import UsageError
from dflashops.core.yaml_files import YAML_HINT, describe_yaml_error, read_yaml_text
from dflashops.playbook.expr import ExprSyntaxError, parse
from dflashops.playbook.vars import PlaybookError, references, render, templated

__all__ = ["PlaybookError", "Playbook", "Step", "load_playbook", "parse_set", "references", "render"]

REQUIRED = object()  # a variable declared with no default
ON_FAILURE = ("stop", "continue", "restart-with-resume")
COMMON_KEYS = {"name", "on_failure", "register"}
# kind -> (required keys, optional keys)
STEP_KINDS: dict[str, tuple[set[str], set[str]]] = {
    "stop": ({"run"}, {"target", "grace"}),
    "sync": (set(), {"target", "profile", "run"}),
    "clear-cache": (set(), {"target", "profile", "run"}),
    "deploy": (set(), {"target", "profile", "name", "parent", "note", "launcher", "clear_cache", "extra_args"}),
    "restart": ({"run"}, {"name", "note", "resume", "clear_cache", "extra_args", "grace", "launcher", "unchecked"}),
    "wait": ({"run", "timeout"}, {"log", "metric", "fail_on", "target", "poll"}),
    "assert": ({"that"}, {"run", "target", "message"}),
    "exec": ({"argv"}, {"target", "check"}),
    "collect": ({"run", "into"}, {"fields", "target"}),
    "loop": ({"items", "steps"}, {"as"}),
    "include": ({"file"}, {"vars"}),
}
MAX_INCLUDE_DEPTH = 16
# Names every playbook may use without declaring them: `target` (play --target) and `latest_run` (the most
# recently started run that is running on that target, looked up only when a playbook refers to it).
BUILTINS = ("target", "latest_run")


class _Map(dict):
    """A YAML mapping that remembers its own line and each key's line (1-based)."""

    line: int = 0
    key_lines: dict[str, int]


class _Loader(yaml.SafeLoader):
    pass


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    out = _Map()
    out.line, out.key_lines = node.start_mark.line + 1, {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[str(key)] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


@dataclass
class Step:
    kind: str
    args: dict[str, Any]
    where: str  # "path:line", for errors and the report
    name: str = ""
    on_failure: str = "stop"
    register: str | None = None
    body: list[Step] = field(default_factory=list)  # loop steps only

    @property
    def label(self) -> str:
        return self.name or self.kind


@dataclass
class Playbook:
    path: Path
    description: str
    variables: dict[str, Any]  # name -> default value or REQUIRED
    var_where: dict[str, str]
    steps: list[Step]

    def bind(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Variables with `--set` values applied; unknown or still-missing names are PlaybookErrors."""
        for key in overrides:
            if key not in self.variables and key not in BUILTINS:
                raise PlaybookError(
                    f"{self.path}: --set {key}=...: the playbook has no variable {key!r}",
                    hint=f"variables: {', '.join(sorted(self.variables)) or '(none)'}",
                )
        values = {**self.variables, **overrides}
        for key, value in values.items():
            if value is REQUIRED:
                raise PlaybookError(
                    f"{self.var_where[key]}: missing variable {key!r} (declared with no default)",
                    hint=f"pass --set {key}=VALUE",
                )
        return values

    def uses(self, name: str, values: dict[str, Any]) -> bool:
        """Whether any step, or any bound variable value, refers to `{{name}}`."""

        def walk(steps: list[Step]) -> bool:
            return any(name in references(s.args) or walk(s.body) for s in steps)

        return walk(self.steps) or any(name in references(v) for v in values.values())


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set key=value` pairs; the value is read as YAML (`3` is a number, `[a, b]` a list)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UsageError(f"--set {item!r}: expected key=value", hint="e.g. --set run=exp-flex5 --set steps=10")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key] = raw
        if out[key] is None:
            out[key] = raw
    return out


def load_playbook(path: str | Path) -> Playbook:
    """Read, resolve includes and validate a playbook (see module doc). Raises PlaybookError."""
    playbook_path = Path(path)
    if not playbook_path.is_file():
        raise PlaybookError(f"playbook {playbook_path} does not exist", hint="see playbooks/ for the shipped ones")
    variables: dict[str, Any] = {}
    var_where: dict[str, str] = {}
    description, steps = _load_file(playbook_path.resolve(), variables, var_where, (), {})
    playbook = Playbook(playbook_path, description, variables, var_where, steps)
    known = set(variables) | set(BUILTINS)
    for key, value in variables.items():
        for name in references(value):
            if name not in known or name == key:
                raise PlaybookError(f"{var_where[key]}: variable {key!r} uses {{{{{name}}}}}, which is not a variable")
    _check_references(playbook.steps, known)
    return playbook


def _read_yaml(path: Path) -> Any:
    try:
        text = read_yaml_text(path, what="playbook", error=PlaybookError)  # size, encoding, depth, alias bounds
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PlaybookError(describe_yaml_error(path, exc), hint=YAML_HINT) from None
    except OSError as exc:
        raise PlaybookError(f"cannot read playbook {path}: {exc.strerror}") from None


def _load_file(
    path: Path,
    variables: dict[str, Any],
    var_where: dict[str, str],
    chain: tuple[Path, ...],
    include_vars: dict[str, Any],
) -> tuple[str, list[Step]]:
    doc = _read_yaml(path)
    if not isinstance(doc, _Map):
        raise PlaybookError(f"{path}:1: a playbook is a mapping with `steps:`", hint="see playbooks/restart-cycle.yaml")
    _keys(doc, str(path), {"steps"}, {"description", "vars"}, "playbook")
    declared = doc.get("vars")
    if declared is None:
        declared = _Map()
        declared.key_lines = {}
    if not isinstance(declared, _Map):
        raise PlaybookError(f"{path}:{doc.key_lines['vars']}: vars: expected a mapping of name: default")
    for key, value in declared.items():
        where = f"{path}:{declared.key_lines[key]}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)):
            raise PlaybookError(f"{where}: invalid variable name {key!r}")
        default = include_vars.get(key, REQUIRED if value is None else value)
        if key not in variables or (variables[key] is REQUIRED and default is not REQUIRED):
            variables[key], var_where[key] = default, where
    return str(doc.get("description") or ""), _steps(
        doc["steps"], path, doc.key_lines["steps"], variables, var_where, (*chain, path)
    )


def _keys(mapping: _Map, where: str, required: set[str], optional: set[str], what: str) -> None:
    for key in mapping:
        if key not in required | optional:
            raise PlaybookError(
                f"{where}:{mapping.key_lines[str(key)]}: unknown key {key!r} in {what}",
                hint=f"allowed: {', '.join(sorted(required | optional))}",
            )
    for key in sorted(required - set(mapping)):
        raise PlaybookError(f"{where}:{mapping.line}: {what} needs {key!r}")


def _steps(
    items: Any, path: Path, line: int, variables: dict[str, Any], var_where: dict[str, str], chain: tuple[Path, ...]
) -> list[Step]:
    if not isinstance(items, list):
        raise PlaybookError(f"{path}:{line}: steps: expected a list of steps")
    out: list[Step] = []
    for item in items:
        if not isinstance(item, _Map):
            raise PlaybookError(f"{path}:{line}: each step is a mapping like `- stop: {{run: NAME}}`")
        where = f"{path}:{item.line}"
        kinds = [key for key in item if key not in COMMON_KEYS]
        unknown = [key for key in kinds if key not in STEP_KINDS]
        if unknown:
            raise PlaybookError(
                f"{path}:{item.key_lines[str(unknown[0])]}: unknown step {unknown[0]!r}",
                hint=f"steps: {', '.join(sorted(STEP_KINDS))}; keys: {', '.join(sorted(COMMON_KEYS))}",
            )
        if len(kinds) != 1:
            raise PlaybookError(
                f"{where}: a step has exactly one kind, found {', '.join(kinds) or 'none'}",
                hint=f"steps: {', '.join(sorted(STEP_KINDS))}",
            )
        kind = kinds[0]
        args = item[kind]
        if args is None:
            args = _Map()
            args.line, args.key_lines = item.key_lines[kind], {}
        if not isinstance(args, _Map):
            raise PlaybookError(f"{path}:{item.key_lines[kind]}: {kind}: expected a mapping of arguments")
        args_where = f"{path}:{args.line or item.key_lines[kind]}"
        _keys(args, str(path), *STEP_KINDS[kind], f"step {kind!r}")
        if kind == "include":
            out.extend(_include(args, path, args_where, variables, var_where, chain))
            continue
        step = Step(
            kind=kind,
            args=dict(args),
            where=where,
            name=str(item.get("name") or ""),
            on_failure=str(item.get("on_failure", "stop")),
            register=item.get("register"),
        )
        _check_step(step, args, path)
        if kind == "loop":
            step.body = _steps(args["steps"], path, args.key_lines["steps"], variables, var_where, chain)
            step.args.pop("steps")
        out.append(step)
    return out


def _include(
    args: _Map, path: Path, where: str, variables: dict[str, Any], var_where: dict[str, str], chain: tuple[Path, ...]
) -> list[Step]:
    target = (path.parent / str(args["file"])).resolve()
    if target in chain:
        cycle = " -> ".join(p.name for p in (*chain[chain.index(target) :], target))
        raise PlaybookError(f"{where}: include cycle: {cycle}", hint="remove one of these includes")
    if len(chain) >= MAX_INCLUDE_DEPTH:
        raise PlaybookError(f"{where}: includes nested deeper than {MAX_INCLUDE_DEPTH}")
    if not target.is_file():
        raise PlaybookError(f"{where}: included playbook {args['file']!r} does not exist ({target})")
    given = args.get("vars") or {}
    if not isinstance(given, dict):
        raise PlaybookError(f"{where}: include vars: expected a mapping")
    return _load_file(target, variables, var_where, chain, dict(given))[1]


def _check_step(step: Step, args: _Map, path: Path) -> None:
    def at(key: str) -> str:
        return f"{path}:{args.key_lines.get(key, args.line)}"

    if step.on_failure not in ON_FAILURE:
        raise PlaybookError(f"{step.where}: on_failure {step.on_failure!r} is not one of {', '.join(ON_FAILURE)}")
    if step.on_failure == "restart-with-resume" and "run" not in args:
        raise PlaybookError(f"{step.where}: on_failure restart-with-resume needs a step that names a `run`")
    if step.register is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(step.register)):
        raise PlaybookError(f"{step.where}: register: {step.register!r} is not a valid variable name")
    if step.kind == "wait":
        if ("log" in args) == ("metric" in args):
            raise PlaybookError(f"{step.where}: wait needs exactly one of `log: REGEX` or `metric: CONDITION`")
        timeout = args.get("timeout")
        if not templated(timeout) and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise PlaybookError(f"{at('timeout')}: wait timeout must be a number of seconds > 0, got {timeout!r}")
    for key in ("log", "fail_on"):
        if isinstance(args.get(key), str) and not templated(args[key]):
            try:
                re.compile(args[key])
            except re.error as exc:
                raise PlaybookError(f"{at(key)}: {key}: invalid regular expression {args[key]!r}: {exc}") from None
    for key in ("metric", "that"):
        if key in args and not templated(args[key]):
            try:
                parse(str(args[key]))
            except ExprSyntaxError as exc:
                raise PlaybookError(
                    f"{at(key)}: {key}: {exc}", hint="conditions look like `step >= 50 and block_tok_s > 5000`"
                ) from None
    if step.kind == "exec" and not (isinstance(args["argv"], list) or templated(args["argv"])):
        raise PlaybookError(f"{at('argv')}: exec argv must be a list of words", hint='argv: [nvidia-smi, "-L"]')
    if step.kind == "loop" and not isinstance(args["steps"], list):
        raise PlaybookError(f"{at('steps')}: loop steps: expected a list of steps")


def _check_references(steps: list[Step], known: set[str]) -> set[str]:
    """Every `{{name}}` must be a variable, `target`, a loop's item, or registered by an EARLIER step."""
    for step in steps:
        for name in references(step.args):
            if name not in known:
                raise PlaybookError(
                    f"{step.where}: step {step.label!r} uses {{{{{name}}}}}, which is not defined before it",
                    hint="declare it under vars:, or register it in an earlier step",
                )
        if step.kind == "loop":
            known = _check_references(step.body, known | {str(step.args.get("as", "item"))})
        if step.register:
            known = known | {step.register}
    return known
