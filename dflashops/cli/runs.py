"""`dflashops runs list|tree|show|diff|sync|plot|export`: the lineage database, viewed and rebuilt.

`register(subparsers)` adds the `runs` parser; each handler takes the parsed Namespace and returns the exit
code, raising DflashopsError for the caller (cli/main.py) to print as `error:`/`hint:`. Data goes to
stdout (tables, trees, `--json`, CSV), progress and warnings to stderr. The database is found by
`lineage_db_path` (`--db`, else `lineage.sqlite` next to the inventory). `python -m dflashops.cli.runs`
runs these verbs on their own (same error printing), for scripts and tests that need no inventory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dflashops.core.errors import DflashopsError, NotFound, UsageError
from dflashops.lineage import LineageDB, diff_runs
from dflashops.lineage.files import (
    import_dict_from_status,
    metric_names,
    metric_series,
    other_node,
    read_metrics,
    run_dir_of,
)
from dflashops.lineage.record import RunRecord

if TYPE_CHECKING:
    from dflashops.ops.releases.compare import FileChanges

Handler = Callable[[argparse.Namespace], int]


def lineage_db_path(args: argparse.Namespace) -> Path:
    """`--db PATH` when given, else `lineage.sqlite` next to the inventory (C1's find_inventory rules:
    --inventory, $DFLASHOPS_INVENTORY, ./inventory.yaml upwards). The inventory is not parsed here, so
    lineage stays readable while inventory.yaml is being edited."""
    if getattr(args, "db", None):
        return Path(args.db)
    from dflashops.core.inventory import find_inventory

    return find_inventory(getattr(args, "inventory", None)).parent / "lineage.sqlite"


def _open(args: argparse.Namespace, *, create: bool = False) -> LineageDB | None:
    """The database, or None when the file does not exist and `create` is False (reads never create it)."""
    path = lineage_db_path(args)
    if not create and not path.exists():
        return None
    return LineageDB(path)


def _missing(args: argparse.Namespace) -> NotFound:
    return NotFound(
        f"no lineage database at {lineage_db_path(args)}",
        hint="deploy a run first, or `dflashops runs sync` to rebuild it from the targets",
    )


def _stdout() -> Console:
    from dflashops.cli.common import output_console

    return output_console()


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _runs_root(args: argparse.Namespace) -> Path | None:
    return Path(args.runs_dir) if getattr(args, "runs_dir", None) else None


def _local_roots(args: argparse.Namespace) -> dict[str, Path]:
    """`<workspace>/runs` of each local target in the inventory, where metrics can be read directly.
    An unreadable inventory yields {}: the lineage views must keep working while it is being fixed."""
    try:
        from dflashops.core.inventory import load_inventory

        inventory = load_inventory(getattr(args, "inventory", None))
    except DflashopsError:
        return {}
    return {t.name: Path(t.workspace) / "runs" for t in inventory.targets.values() if t.kind == "local"}


def _facts(args: argparse.Namespace, db: LineageDB | None = None) -> Any:
    """Every view's source of a run's state (RunFacts): its run directory when it is on this machine, read now
    by the agent as `dflashops status` reads it, else the record and when it was written."""
    from dflashops.cli.lineage_view import RunFacts

    return RunFacts(_runs_root(args), {} if _runs_root(args) else _local_roots(args), db)


# ---------------------------------------------------------------------------------------------- verbs
LIST_PAGE = 50  # rows of the `runs list` table by default: the newest first, --page/--limit/--all for others


def cmd_list(args: argparse.Namespace) -> int:
    from dflashops.cli.lineage_view import current_record, runs_table

    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, not {args.limit}", hint="--limit 50, or --all for every run")
    if args.page < 1:
        raise UsageError(f"--page must be at least 1, not {args.page}", hint="--page 1 is the newest runs")
    if args.all and (args.limit is not None or args.page > 1):
        raise UsageError("--all lists every run; --limit and --page choose a page", hint="give one of them")
    # The table shows a page (LIST_PAGE rows) unless asked for all; --json every run unless asked for a page.
    paged = not args.all and (args.limit is not None or args.page > 1 or not args.json)
    limit = (args.limit or LIST_PAGE) if paged else None
    offset = (args.page - 1) * limit if limit else 0
    db = _open(args)
    facts = _facts(args, db)
    total = 0
    if db is None:
        runs = []
    elif args.state:  # the state the table shows (the run directory's, when it is here), not the last recorded one
        matching = [run for run in db.list(target=args.target, newest_first=True) if facts(run).state == args.state]
        total, runs = len(matching), matching[offset : offset + limit] if limit else matching
    else:
        total = db.count(target=args.target)
        runs = db.list(target=args.target, newest_first=True, limit=limit, offset=offset)
    if args.json:
        _print_json([current_record(run, facts(run)) for run in runs])
    elif not runs:
        asked = [f"--{key} {getattr(args, key)}" for key in ("state", "target") if getattr(args, key)]
        if total:
            print(
                f"no runs on page {args.page}: {total} runs make {-(-total // (limit or total))} pages", file=sys.stderr
            )
        elif db is not None and asked and db.count():  # runs are recorded, none of them matches
            print(f"no runs match {' '.join(asked)}", file=sys.stderr)
        else:
            print("no runs recorded" + ("" if db else f" (no database at {lineage_db_path(args)})"), file=sys.stderr)
    else:
        _stdout().print(runs_table(runs, facts))
    if runs and len(runs) < total:
        more = f" --page {args.page + 1}" if offset + len(runs) < total else ""
        print(
            f"runs {offset + 1}-{offset + len(runs)} of {total}, newest first"
            + (f"; the next:{more}" if more else "")
            + "; --all for every run",
            file=sys.stderr,
        )
    return 0


def cmd_tree(args: argparse.Namespace) -> int:
    from dflashops.cli.lineage_view import forest_json, forest_plain, forest_tree, lineage_forest

    db = _open(args)
    if db is None:
        if args.run:
            raise _missing(args)
        forest: list[dict[str, Any]] = []
    else:
        if args.run:
            db.get(args.run)  # NotFound with close names
        forest = lineage_forest(db, _facts(args, db), only=args.run)
    if args.json:
        sys.stdout.write(forest_json(forest))
    elif not forest:
        print("no runs recorded", file=sys.stderr)
    else:
        console, title = _stdout(), f"lineage ({lineage_db_path(args)})"
        if console.is_terminal:
            console.print(forest_tree(forest, title), soft_wrap=True)  # a terminal folds long lines itself
        else:
            sys.stdout.write(forest_plain(forest, title))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from dflashops.cli.lineage_view import current_record, show_table

    db = _open(args) or _raise(_missing(args))
    run = db.get(args.run)
    parent = db.get(run.parent) if run.parent and run.parent in db.names() else None
    changes = diff_runs(parent, run).lines() if parent else []
    children = [child.name for child in db.children(run.name)]
    fact = _facts(args, db)(run)
    row = current_record(run, fact)
    if args.json:
        _print_json({**row, "children": children, "changes_vs_parent": changes})
        return 0
    if fact.as_of is not None and not run.extra.get("collected"):
        print(
            f"note: {run.name}'s state is as recorded at {fact.as_of}: its run directory is on {run.target}, not "
            f"on this machine (`dflashops status {run.name}` reads it there)",
            file=sys.stderr,
        )
    console = _stdout()
    console.print(show_table(row))
    console.print(f"children: {', '.join(children) or '-'}", markup=False)
    if parent:
        console.print(f"changes vs parent {parent.name}:", markup=False)
        for line in changes or ["(none)"]:
            console.print(f"  {line}", markup=False)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    db = _open(args) or _raise(_missing(args))
    a, b = db.get(args.a), db.get(args.b)
    diff = diff_runs(a, b)
    files = code_files(args, a, b)
    if args.json:
        _print_json({**diff.to_dict(), **({"files": files.to_dict()} if files else {})})
        return 0
    print(f"diff {args.a} -> {args.b}")
    for line in diff.lines() or ["no differences in arguments, env, code hash, profile, target, GPUs or launcher"]:
        print(f"  {line}")
    for line in files.lines() if files else []:
        print(f"    {line}")
    return 0


def code_files(args: argparse.Namespace, a: RunRecord, b: RunRecord) -> FileChanges | None:
    """The files that differ between two runs' code (ops/releases/compare.py), read from their targets'
    releases; None when the code hash is the same (or not recorded). A target that cannot be asked makes the
    answer "not known", with why: the lineage's own diff above still stands."""
    if not a.code_hash or not b.code_hash or a.code_hash == b.code_hash:
        return None
    from dflashops.cli.common import open_invocation
    from dflashops.ops.releases.compare import FileChanges, file_changes

    try:
        with open_invocation(args) as invocation:
            inventory = invocation.inventory
            return file_changes(
                invocation.agent(inventory.target(a.target)),
                a.code_hash,
                invocation.agent(inventory.target(b.target)),
                b.code_hash,
            )
    except DflashopsError as exc:
        return FileChanges(unknown=exc.message)


def cmd_sync(args: argparse.Namespace) -> int:
    """Rebuild lineage from run.json files: of a local workspace folder (`--workspace`), or of targets
    through the agent's `status` verb (the same state rules `dflashops status` uses)."""
    sources: list[tuple[str, list[dict[str, Any]]]] = []
    if args.workspace:
        from dflashops.ops.runs.local_runs import LocalRuns

        workspace = Path(args.workspace).resolve()
        if not workspace.is_dir():
            raise NotFound(f"workspace folder {workspace} does not exist")
        sources.append((args.target_label, LocalRuns().statuses(workspace)))
    targets = list(args.targets)
    if not targets and not args.workspace:  # `runs sync` alone (what every recovery hint says): all targets
        from dflashops.core.inventory import load_inventory

        targets = list(load_inventory(getattr(args, "inventory", None)).targets)
    for target in targets:
        sources.append((target, _statuses_from_target(args, target)))
    if not sources:
        raise UsageError(
            "nothing to sync from: the inventory has no targets",
            hint="name targets (`runs sync local`) or pass --workspace DIR",
        )
    db = LineageDB(lineage_db_path(args))
    outcomes: list[dict[str, str]] = []
    with db.batch():  # one transaction for every run: 1,000 commits took 3.5 s at 400 runs
        for target, statuses in sources:
            outcomes.extend(_import_statuses(db, target, statuses))
    if args.json:
        _print_json(outcomes)
    else:
        for item in outcomes:
            print(
                f"{item['outcome']:<9} {item['name']} ({item['target']}){'  ' + item['reason'] if item['reason'] else ''}"
            )
    counts = {
        key: sum(1 for o in outcomes if o["outcome"] == key) for key in ("added", "updated", "unchanged", "failed")
    }
    print("sync: " + ", ".join(f"{n} {key}" for key, n in counts.items()), file=sys.stderr)
    return 1 if counts["failed"] else 0


def _import_statuses(db: LineageDB, target: str, statuses: list[dict[str, Any]]) -> list[dict[str, str]]:
    """`runs sync`'s outcome for each of a target's status entries, imported into `db`."""
    outcomes: list[dict[str, str]] = []
    for status in statuses:
        if (node := other_node(status)) is not None:
            outcomes.append(
                {
                    "name": str(status.get("name")),
                    "target": target,
                    "outcome": "skipped",
                    "reason": f"node {node} of a run on several targets (its row is node 0's)",
                }
            )
            continue
        data = import_dict_from_status(status, target)
        if data is None:
            outcomes.append(
                {"name": str(status.get("name")), "target": target, "outcome": "skipped", "reason": "no run.json"}
            )
            continue
        outcome: str
        try:
            outcome, reason = db.import_run_json(data), ""
        except DflashopsError as exc:
            outcome, reason = "failed", exc.message
        outcomes.append({"name": str(data["name"]), "target": target, "outcome": outcome, "reason": reason})
    return outcomes


def _statuses_from_target(args: argparse.Namespace, target: str) -> list[dict[str, Any]]:
    """The agent's `status` answer for every run on `target` (through the invocation's agent): the entries only,
    read into the database `runs sync` writes (`--db` may name one other than the inventory's); no observer step."""
    from dflashops.cli.common import open_invocation
    from dflashops.ops.agent_client import StatusAnswer, answer_json

    with open_invocation(args) as invocation:
        tgt = invocation.inventory.target(target)
        answer = invocation.agent(tgt).ask("status", {"workspace": tgt.workspace}, StatusAnswer)
        return [answer_json(entry) for entry in answer.runs] if answer is not None else []


def cmd_plot(args: argparse.Namespace) -> int:
    from dflashops.ops.observe.plot import plot_runs, require_matplotlib

    require_matplotlib()
    db = _open(args) or _raise(_missing(args))
    runs = [db.get(name) for name in args.runs]
    local_roots = {} if _runs_root(args) else _local_roots(args)
    series: dict[str, list[tuple[int, float]]] = {}
    found: set[str] = set()
    for run in runs:
        directory = run_dir_of(run, _runs_root(args), local_roots)
        rows = read_metrics(directory / "metrics.jsonl") if directory else []
        if directory is None:
            print(
                f"warning: metrics of {run.name} are on target {run.target}, not on this machine "
                "(pass --runs-dir with a local copy)",
                file=sys.stderr,
            )
        elif not rows:
            print(f"warning: {run.name} has no metrics in {directory / 'metrics.jsonl'}", file=sys.stderr)
        found |= metric_names(rows)
        series[run.name] = metric_series(rows, args.metric)
        if rows and not series[run.name]:
            print(f"warning: {run.name} has no {args.metric!r} values", file=sys.stderr)
    if not any(series.values()):
        raise UsageError(
            f"no run among {', '.join(args.runs)} has metric {args.metric!r}",
            hint=f"metrics found: {', '.join(sorted(found))}" if found else "no metrics found at all",
        )
    target = Path(args.out) if args.out else default_plot_file(args)
    out = plot_runs(series, args.metric, target, title=args.title, log_y=args.log_y)
    if not args.out:
        print(f"plot of {args.metric} written to {out} (--out FILE.png names another file)", file=sys.stderr)
    print(out)
    return 0


def default_plot_file(args: argparse.Namespace) -> Path:
    """`t1-t2-loss.png` in this folder; `t1-t2-loss-2.png` (and on) when that exists: a default never writes
    over a file (`runs plot` without `--out` was an argparse error)."""
    stem = "-".join([*args.runs[:4], *(["more"] if len(args.runs) > 4 else []), args.metric.replace(".", "_")])
    path, number = Path(f"{stem}.png"), 1
    while path.exists():
        number += 1
        path = Path(f"{stem}-{number}.png")
    return path


def cmd_export(args: argparse.Namespace) -> int:
    from dflashops.cli.lineage_view import current_record, export_text

    if args.json and args.format == "csv":
        raise UsageError("--json and --format csv ask for different formats", hint="give one of them")
    db = _open(args)
    facts = _facts(args, db)
    rows = [current_record(run, facts(run)) for run in ([] if db is None else db.list())]
    text = export_text(rows, "json" if args.json else args.format or "csv")
    if args.out in (None, "-"):
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"folder {out.parent} does not exist", hint="create it or choose another --out")
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, out)  # an existing export is replaced whole or not at all
    print(out)
    return 0


def _raise(error: DflashopsError) -> Any:
    raise error


# ------------------------------------------------------------------------------------------- parsers
def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `runs` and its verbs to the top-level subparsers. Handlers are set as `handler` (and `func`)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", metavar="PATH", help="lineage database (default: lineage.sqlite next to the inventory)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON on stdout")
    local_dirs = argparse.ArgumentParser(add_help=False)
    local_dirs.add_argument(
        "--runs-dir",
        metavar="DIR",
        help="local folder holding <run>/metrics.jsonl (default: each run's recorded run_dir)",
    )

    runs = subparsers.add_parser(
        "runs", help="run lineage: list, tree, show, diff, sync, plot, export", description=__doc__.split("\n\n")[0]
    )
    verbs = runs.add_subparsers(dest="runs_verb", metavar="VERB", required=True)

    def add(name: str, handler: Handler, help_text: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = verbs.add_parser(name, help=help_text, parents=[common, *parents])
        parser.set_defaults(handler=handler, func=handler)
        return parser

    p = add("list", cmd_list, f"recorded runs, newest first ({LIST_PAGE} a page; --json: all)", as_json, local_dirs)
    p.add_argument("--limit", type=int, metavar="N", help=f"runs a page (default {LIST_PAGE}; with --json, all)")
    p.add_argument("--page", type=int, default=1, metavar="P", help="which page, 1 the newest (default 1)")
    p.add_argument("--all", action="store_true", help="every run, not a page")
    p.add_argument(
        "--state",
        choices=("launched", "running", "finished", "crashed", "stopped"),
        help="only runs in this state (as the table shows it: read from the run directory when it is here)",
    )
    p.add_argument("--target", help="only runs on this target")
    p = add("tree", cmd_tree, "lineage tree: state, steps, best tau_sim, note, change vs parent", as_json, local_dirs)
    p.add_argument("run", nargs="?", help="show only this run's ancestors and descendants")
    add("show", cmd_show, "one run's record, children and change vs parent", as_json).add_argument("run")
    p = add("diff", cmd_diff, "argument, env, code-hash, profile and target changes from A to B", as_json)
    p.add_argument("a")
    p.add_argument("b")
    p = add("sync", cmd_sync, "rebuild lineage from each run's run.json on targets", as_json)
    p.add_argument(
        "targets", nargs="*", metavar="TARGET", help="targets to read (default: every target of the inventory)"
    )
    p.add_argument("--workspace", metavar="DIR", help="a local workspace folder (holds runs/<name>/run.json)")
    p.add_argument("--target-label", default="local", help="target name recorded for --workspace runs")
    p = add("plot", cmd_plot, "PNG of a metric by step for several runs (readable without colour)", local_dirs)
    p.add_argument("runs", nargs="+", metavar="RUN")
    p.add_argument("--metric", default="loss", help="loss, tau_sim, block_tok_s, or any metrics.jsonl key (loss.ce)")
    p.add_argument(
        "--out",
        metavar="FILE.png",
        help="the PNG file to write (default: RUN-RUN-METRIC.png in this folder, numbered rather than overwritten)",
    )
    p.add_argument("--title", help="the plot's title (default: METRIC by step)")
    p.add_argument("--log-y", action="store_true", help="logarithmic y axis (for losses over many steps)")
    p = add("export", cmd_export, "all records as CSV or JSON")
    p.add_argument("--json", action="store_true", help="JSON instead of CSV (the same as --format json)")
    p.add_argument("--format", choices=("csv", "json"), help="csv (default) or json")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    return runs
