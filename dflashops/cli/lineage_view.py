"""Renderables for the lineage verbs: the run tree, tables, JSON shapes, CSV export. Nothing here prints.

Meaning never rides on colour alone: a run's state is always written out as a word (colour only repeats
it), changes are marked with `+ - ~`, and rich drops the colour itself when NO_COLOR is set or stdout is
not a terminal.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from dflashops.lineage import LineageDB, RunRecord, diff_runs
from dflashops.lineage.files import AGENT_STATE_TO_LINEAGE, best_value, metric_series, read_metrics, run_dir_of
from dflashops.ops.local_runs import LocalRuns

STATE_STYLE = {
    "launched": "cyan",
    "running": "bold blue",
    "finished": "green",
    "crashed": "bold red",
    "stopped": "yellow",
}
EXPORT_COLUMNS = tuple(RunRecord.__dataclass_fields__)


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


class RunFacts:
    """Per-run facts (cached) for the views: last step and best tau_sim from metrics.jsonl, and for runs
    whose directory is on this machine the live state from the same rules `dflashops status` uses (the
    agent's run_status). Views only read: `runs sync` / `dflashops status` write states to the database."""

    def __init__(self, runs_root: Path | None, local_roots: Mapping[str, Path] | None = None) -> None:
        self.runs_root = runs_root
        self.local_roots = dict(local_roots or {})
        self._cache: dict[str, Facts] = {}
        self.local = LocalRuns()  # the agent, as a process, for run directories on this machine

    def __call__(self, run: RunRecord) -> Facts:
        if run.name not in self._cache:
            directory = run_dir_of(run, self.runs_root, self.local_roots)
            rows = read_metrics(directory / "metrics.jsonl") if directory else []
            steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
            best = best_value(metric_series(rows, "tau_sim"), "tau_sim")
            if best is None and isinstance(run.extra.get("best_tau_sim"), (int, float)):
                best = float(run.extra["best_tau_sim"])
            state, exit_code = run.state, run.exit_code
            live = (
                self.local.status(directory) if directory is not None and (directory / "run.json").is_file() else None
            )
            if live is not None:
                state = AGENT_STATE_TO_LINEAGE.get(str(live.get("state")), state)
                exit_code = live.get("exit_code", exit_code)
            self._cache[run.name] = Facts(max(steps) if steps else run.last_step, best, state, exit_code)
        return self._cache[run.name]


def _roots(runs: list[RunRecord]) -> list[RunRecord]:
    names = {run.name for run in runs}
    return [run for run in runs if run.parent is None or run.parent not in names]


def lineage_forest(db: LineageDB, facts: RunFacts, only: str | None = None) -> list[dict[str, Any]]:
    """Nested dicts (name, state, last_step, best_tau_sim, note, parent, changes, children), roots first.
    With `only`, just the tree that contains that run (from its lineage root)."""
    runs = db.list()
    by_name = {run.name: run for run in runs}
    kids: dict[str, list[RunRecord]] = {}
    for run in runs:
        if run.parent in by_name:
            kids.setdefault(run.parent, []).append(run)
    roots = [by_name[db.root(only)]] if only else _roots(runs)
    seen: set[str] = set()

    def node(run: RunRecord) -> dict[str, Any]:
        seen.add(run.name)
        fact = facts(run)
        parent = by_name.get(run.parent) if run.parent else None
        return {
            "name": run.name,
            "state": fact.state,
            "exit_code": fact.exit_code,
            "last_step": fact.last_step,
            "best_tau_sim": fact.best_tau_sim,
            "note": run.note,
            "parent": run.parent,
            "parent_recorded": parent is not None,
            "changes": diff_runs(parent, run).lines() if parent else [],
            "change_summary": diff_runs(parent, run).summary() if parent else "",
            "children": [node(child) for child in kids.get(run.name, []) if child.name not in seen],
        }

    return [node(root) for root in roots if root.name not in seen]


def _label(item: dict[str, Any]) -> Text:
    text = Text()
    text.append(item["name"], style="bold")
    state = state_word(item["state"], item["exit_code"])
    text.append(f"  [{state}]", style=STATE_STYLE.get(item["state"], ""))
    if item["last_step"] is not None:
        text.append(f"  step {item['last_step']}")
    if item["best_tau_sim"] is not None:
        text.append(f"  best tau_sim {item['best_tau_sim']:.3f}")
    if item["parent"] and not item["parent_recorded"]:
        text.append(f"  (parent {item['parent']} not recorded)", style="dim")
    if item["note"]:
        text.append(f"\n  note: {item['note']}", style="italic")
    if item["change_summary"]:
        text.append(f"\n  vs parent: {item['change_summary']}", style="dim")
    return text


def forest_tree(forest: list[dict[str, Any]], title: str) -> Tree:
    """One rich Tree whose top-level branches are the lineage roots."""
    tree = Tree(Text(title, style="bold"), guide_style="dim")

    def add(branch: Tree, item: dict[str, Any]) -> None:
        child = branch.add(_label(item))
        for sub in item["children"]:
            add(child, sub)

    for root in forest:
        add(tree, root)
    return tree


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


def show_table(run: RunRecord) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in run.to_dict().items():
        if key == "state":
            table.add_row(key, Text(state_word(run.state, run.exit_code), style=STATE_STYLE.get(run.state, "")))
            continue
        if isinstance(value, (list, dict)):
            value = json.dumps(value, sort_keys=True) if value else "-"
        table.add_row(key, escape("-" if value in (None, "") else str(value)))
    return table


def export_text(runs: list[RunRecord], fmt: str) -> str:
    """All records as JSON (a list of objects) or CSV (one row per run; lists/dicts as JSON cells)."""
    if fmt == "json":
        return json.dumps([run.to_dict() for run in runs], indent=2, sort_keys=True) + "\n"
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=EXPORT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for run in runs:
        row = run.to_dict()
        writer.writerow(
            {k: json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v for k, v in row.items()}
        )
    return buffer.getvalue()


def where(run: RunRecord) -> str:
    """The target column: the target, or for a run on several targets every node's (node 0 first)."""
    nodes = run.extra.get("nodes") or []
    return ",".join(str(node.get("target")) for node in nodes) if len(nodes) >= 2 else run.target
