"""Renderables for the lineage verbs: the run tree, tables, JSON shapes, CSV export. Nothing here prints.

Meaning never rides on colour alone: a run's state is always written out as a word (colour only repeats
it), changes are marked with `+ - ~`, and rich drops the colour itself when NO_COLOR is set or stdout is
not a terminal.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dflashops.lineage import LineageDB, RunRecord, diff_runs
from dflashops.lineage.files import AGENT_STATE_TO_LINEAGE, best_value, metric_series, read_metrics, run_dir_of
from dflashops.lineage.record import utc_now_iso
from dflashops.ops.runs.local_runs import LocalRuns

STATE_STYLE = {
    "launched": "cyan",
    "running": "bold blue",
    "finished": "green",
    "crashed": "bold red",
    "stopped": "yellow",
}
EXPORT_COLUMNS = (*RunRecord.__dataclass_fields__, "state_as_of", "state_from")


def state_word(state: str, exit_code: int | None) -> str:
    """`crashed (exit 1)`, `finished`, ... (the exit code matters for crashed and stopped runs)."""
    if exit_code is not None and state in ("crashed", "stopped"):
        return f"{state} (exit {exit_code})"
    return state


@dataclass(frozen=True)
class Facts:
    """What the run's local files say now (falls back to the record where the files are not reachable)."""

    last_step: int | None
    best_tau_sim: float | None
    state: str
    exit_code: int | None
    as_of: str | None = None  # None: read now from the run directory; else when the record was last written

    def where_from(self, run: RunRecord) -> str:
        """Where the state came from, in words (`runs show`, the `state_from` of `runs export`)."""
        if self.as_of is None:
            return "run directory"
        if run.extra.get("collected"):
            return "lineage record (its run directory was deleted by gc)"
        return f"lineage record (its run directory on {where(run)} is not on this machine)"


class RunFacts:
    """Per-run facts (cached) for the views: the last step, and for runs whose directory is on this machine
    the live state from the same rules `dflashops status` uses (the agent's run_status, one agent process per
    workspace). Only the last 16 KB of metrics.jsonl is read for the step (a table row of 1,000 local runs
    paid a full parse of each file); best tau_sim, which needs every row, is read for the tree alone
    (`best_tau_sim`). Views only read: `runs sync` / `dflashops status` write states to the database."""

    def __init__(
        self, runs_root: Path | None, local_roots: Mapping[str, Path] | None = None, db: LineageDB | None = None
    ) -> None:
        self.runs_root = runs_root
        self.local_roots = dict(local_roots or {})
        self.db = db  # for when a record that could not be read live was last written
        self._cache: dict[str, Facts] = {}
        self._best: dict[str, float | None] = {}
        self._updated_at: dict[str, str] | None = None
        self.local = LocalRuns()  # the agent, as a process, for run directories on this machine

    def __call__(self, run: RunRecord) -> Facts:
        if run.name not in self._cache:
            directory = run_dir_of(run, self.runs_root, self.local_roots)
            steps = last_steps(directory / "metrics.jsonl") if directory else []
            state, exit_code = run.state, run.exit_code
            live = (
                self.local.status(directory) if directory is not None and (directory / "run.json").is_file() else None
            )
            as_of = None
            if live is not None:
                state = AGENT_STATE_TO_LINEAGE.get(str(live.get("state")), state)
                exit_code = live.get("exit_code", exit_code)
                if isinstance(live.get("step"), int):
                    steps.append(live["step"])
            else:
                as_of = self.updated_at(run.name) or run.started_at
            self._cache[run.name] = Facts(max(steps) if steps else run.last_step, None, state, exit_code, as_of)
        return self._cache[run.name]

    def best_tau_sim(self, run: RunRecord) -> float | None:
        """The best tau_sim in the run's metrics.jsonl (every row read), else the one recorded in its extra."""
        if run.name not in self._best:
            directory = run_dir_of(run, self.runs_root, self.local_roots)
            best = best_tau_sim_of(directory / "metrics.jsonl") if directory else None
            if best is None and isinstance(run.extra.get("best_tau_sim"), (int, float)):
                best = float(run.extra["best_tau_sim"])
            self._best[run.name] = best
        return self._best[run.name]

    def updated_at(self, name: str) -> str | None:
        """When the run's row was last written; every row's read in one query the first time."""
        if self.db is None:
            return None
        if self._updated_at is None:
            self._updated_at = self.db.updated_at_all()
        return self._updated_at.get(name)


_TAU_SIM = re.compile(rb'"tau_sim": *([^,}\]\s]+)')


def best_tau_sim_of(path: Path) -> float | None:
    """The highest tau_sim in a metrics.jsonl, from one regular-expression pass over its complete lines (the
    trainer writes it as a number): 1,000 runs' files parsed row by row as JSON took seconds of `runs tree`.
    A file where tau_sim is anything but a plain number (a list per drafter) is read row by row as before."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    data = data[: data.rfind(b"\n") + 1]  # a torn last line (the trainer is writing it) is left out
    values: list[float] = []
    for match in _TAU_SIM.finditer(data):
        token = match.group(1)
        if token[:1] in (b"[", b"{"):
            return best_value(metric_series(read_metrics(path), "tau_sim"), "tau_sim")
        try:
            value = float(token)
        except ValueError:
            continue  # null, a string: no value, as metric_value says
        if math.isfinite(value):
            values.append(value)
    return max(values) if values else None


def last_steps(path: Path, max_bytes: int = 16384) -> list[int]:
    """The steps of the rows in the last `max_bytes` of a metrics.jsonl (a torn line is skipped)."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - max_bytes))
            tail = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    steps: list[int] = []
    for line in tail:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            steps.append(row["step"])
    return steps


def _roots(runs: list[RunRecord]) -> list[RunRecord]:
    names = {run.name for run in runs}
    return [run for run in runs if run.parent is None or run.parent not in names]


def lineage_forest(db: LineageDB, facts: RunFacts, only: str | None = None) -> list[dict[str, Any]]:
    """Nested dicts (name, state, last_step, best_tau_sim, note, parent, changes, children), roots first.
    With `only`, that run's recorded ancestors (from its lineage root down) and all its descendants: only
    those rows are read (LineageDB.family), not the whole lineage.

    Built without recursion: a restart chain is as deep as its generations (10,000 after weeks of a
    supervisor's `on_failure: resume`), far past Python's recursion limit."""
    runs = db.family(only) if only else db.list()
    by_name = {run.name: run for run in runs}
    kids: dict[str, list[RunRecord]] = {}
    for run in runs:
        if run.parent in by_name:
            kids.setdefault(run.parent, []).append(run)
    seen: set[str] = set()
    forest: list[dict[str, Any]] = []
    for root in _roots(runs):
        stack: list[tuple[RunRecord, list[dict[str, Any]]]] = [(root, forest)]
        while stack:
            run, siblings = stack.pop()
            if run.name in seen:
                continue
            seen.add(run.name)
            fact = dataclasses.replace(facts(run), best_tau_sim=facts.best_tau_sim(run))
            item = _node(run, by_name.get(run.parent) if run.parent else None, fact)
            siblings.append(item)
            # reversed: the stack pops the oldest child first, so children stay in started_at order
            stack.extend((child, item["children"]) for child in reversed(kids.get(run.name, [])))
    return forest


def _node(run: RunRecord, parent: RunRecord | None, fact: Facts) -> dict[str, Any]:
    diff = diff_runs(parent, run) if parent else None
    return {
        "name": run.name,
        "state": fact.state,
        "exit_code": fact.exit_code,
        "last_step": fact.last_step,
        "best_tau_sim": fact.best_tau_sim,
        "state_as_of": fact.as_of,
        "collected": run.extra.get("collected"),
        "note": run.note,
        "parent": run.parent,
        "parent_recorded": parent is not None,
        "changes": diff.lines() if diff else [],
        "change_summary": diff.summary() if diff else "",
        "children": [],
    }


def forest_json(forest: list[dict[str, Any]]) -> str:
    """The forest as JSON text, written without recursion (json.dumps recurses once per level, which a
    restart chain 10,000 generations deep overflows). Each node's own fields are sorted, `children` last."""
    parts: list[str] = []
    stack: list[dict[str, Any] | str] = ["\n"]  # what is left to write, last first: a node, or literal text
    _push_list(stack, forest)
    while stack:
        top = stack.pop()
        if isinstance(top, str):
            parts.append(top)
            continue
        fields = {key: value for key, value in top.items() if key != "children"}
        parts.append(json.dumps(fields, sort_keys=True, default=str)[:-1] + (", " if fields else "") + '"children": ')
        stack.append("}")
        _push_list(stack, top["children"])
    return "".join(parts)


def _push_list(stack: list[dict[str, Any] | str], items: list[dict[str, Any]]) -> None:
    """Push `[item, item, ...]` onto forest_json's stack (reversed: the stack pops the first item first)."""
    stack.append("]")
    for index, item in enumerate(reversed(items)):
        stack.append(item)
        if index < len(items) - 1:
            stack.append(", ")
    stack.append("[")


Segment = tuple[str, str]  # (text, rich style): one run of a line of the tree


def _label(item: dict[str, Any]) -> list[list[Segment]]:
    """A run's lines in the tree: name, state, step, best tau_sim, ...; then its note and its change vs parent."""
    first: list[Segment] = [(item["name"], "bold")]
    state = state_word(item["state"], item["exit_code"])
    first.append((f"  [{state}]", STATE_STYLE.get(item["state"], "")))
    if item["last_step"] is not None:
        first.append((f"  step {item['last_step']}", ""))
    if item["best_tau_sim"] is not None:
        first.append((f"  best tau_sim {item['best_tau_sim']:.3f}", ""))
    if item.get("collected"):
        first.append((f"  [collected: run directory deleted by gc at {item['collected'].get('at')}]", "dim"))
    elif item.get("state_as_of"):
        first.append((f"  (state as recorded {item['state_as_of']})", "dim"))
    if item["parent"] and not item["parent_recorded"]:
        first.append((f"  (parent {item['parent']} not recorded)", "dim"))
    lines = [first]
    if item["note"]:
        lines.extend([(text, "italic")] for text in f"  note: {item['note']}".split("\n"))
    if item["change_summary"]:
        lines.append([(f"  vs parent: {item['change_summary']}", "dim")])
    return lines


def forest_lines(forest: list[dict[str, Any]], title: str) -> list[list[Segment]]:
    """The forest's lines under `title`: roots and siblings hang from `├── `/`└── ` guides; a run's only
    child continues in its parent's column, marked `↳ `, so a restart chain is a column (10,000 generations
    indented 4 columns each would be lines of 40,000 columns). Built without recursion (see lineage_forest)."""
    out: list[list[Segment]] = [[(title, "bold")]]
    # (item, prefix of its first line, prefix of its further lines and of its children's guides)
    stack: list[tuple[dict[str, Any], str, str]] = []

    def push_children(items: list[dict[str, Any]], prefix: str, branch_prefix: str, only_child_continues: bool) -> None:
        if len(items) == 1 and only_child_continues:
            stack.append((items[0], prefix + "↳ ", prefix))
            return
        prefix = branch_prefix  # siblings hang under their parent's name (a `↳ ` parent's name is 2 further in)
        for index, item in reversed(list(enumerate(items))):
            last = index == len(items) - 1
            stack.append((item, prefix + ("└── " if last else "├── "), prefix + ("    " if last else "│   ")))

    push_children(forest, "", "", only_child_continues=False)
    while stack:
        item, first, rest = stack.pop()
        continued = rest + ("  " if first.endswith("↳ ") else "")
        for number, line in enumerate(_label(item)):
            out.append([(first if number == 0 else continued, "dim"), *line])
        push_children(item["children"], rest, continued, only_child_continues=True)
    return out


def forest_tree(forest: list[dict[str, Any]], title: str) -> Text:
    """forest_lines as one rich Text, for a terminal (colour repeats what the words say)."""
    return Text("\n").join(Text.assemble(*line) for line in forest_lines(forest, title))


def forest_plain(forest: list[dict[str, Any]], title: str) -> str:
    """forest_lines as plain text, for a pipe or file: no rich on the way (rich measured and wrapped 20,000
    lines of a 10,000-run tree in 5 of its 8 s)."""
    return "".join("".join(text for text, _ in line) + "\n" for line in forest_lines(forest, title))


def runs_table(runs: list[RunRecord], facts: Callable[[RunRecord], Facts]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("name", "parent", "state", "step", "target", "started", "note"):
        table.add_column(column, overflow="fold", no_wrap=column in ("name", "state", "started"))
    for run in runs:
        fact = facts(run)
        table.add_row(
            escape(run.name),
            escape(run.parent or "-"),
            Text(state_word(fact.state, fact.exit_code), style=STATE_STYLE.get(fact.state, "")),
            "-" if fact.last_step is None else str(fact.last_step),
            escape(where(run)),
            run.started_at,
            escape(run.note),
        )
    return table


def current_record(run: RunRecord, fact: Facts) -> dict[str, Any]:
    """The run's record as `runs show` and `runs export` give it: state, exit code and last step as the run
    directory holds them now (the Facts), with when that state was seen (`state_as_of`) and from where."""
    return {
        **run.to_dict(),
        "state": fact.state,
        "exit_code": fact.exit_code,
        "last_step": fact.last_step,
        "state_as_of": fact.as_of or utc_now_iso(),
        "state_from": fact.where_from(run),
    }


def show_table(row: dict[str, Any]) -> Table:
    """One run's current_record as a two-column table."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in row.items():
        if key == "state":
            table.add_row(key, Text(state_word(value, row["exit_code"]), style=STATE_STYLE.get(value, "")))
            continue
        if isinstance(value, (list, dict)):
            value = json.dumps(value, sort_keys=True) if value else "-"
        table.add_row(key, escape("-" if value in (None, "") else str(value)))
    return table


def export_text(rows: list[dict[str, Any]], fmt: str) -> str:
    """Records (current_record rows) as JSON (a list of objects) or CSV (one row per run; lists/dicts as JSON
    cells)."""
    if fmt == "json":
        return json.dumps(rows, indent=2, sort_keys=True) + "\n"
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=EXPORT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {k: json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v for k, v in row.items()}
        )
    return buffer.getvalue()


def where(run: RunRecord) -> str:
    """The target column: the target, or for a run on several targets every node's (node 0 first)."""
    nodes = run.extra.get("nodes") or []
    return ",".join(str(node.get("target")) for node in nodes) if len(nodes) >= 2 else run.target
