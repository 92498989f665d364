"""Reading what runs left behind: metrics.jsonl series for the tree and plots, and agent status for sync.

The trainer appends to `metrics.jsonl` while we read it, so a torn last line is normal and is skipped,
not an error. A metric may be a number, a per-drafter list/dict (`block_tok_s: [5100, 4980]`, summed: it
is throughput), or a dict of terms with a `total` (`loss: {"total": 2.1, "ce": 1.9}`); a dotted name such
as `loss.ce` picks one term.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflashops.lineage.record import RunRecord

# Agent states (dflashops/agent/status.py run_status) -> lineage states. "lost" = no live process and no exit
# code: the process vanished without its wrapper (OOM killer, container restart), which is a crash.
AGENT_STATE_TO_LINEAGE = {
    "launching": "launched",
    "running": "running",
    "stopping": "running",
    "stopped": "stopped",
    "finished": "finished",
    "crashed": "crashed",
    "lost": "crashed",
}
HIGHER_IS_BETTER = {"tau_sim": True, "block_tok_s": True, "ctx_tok_s": True, "loss": False}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file; unparsable lines (a torn final write) are skipped. [] if absent."""
    rows: list[dict[str, Any]] = []
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return []
    return rows


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def metric_value(row: Mapping[str, Any], metric: str) -> float | None:
    """The value of `metric` in one metrics row (see module doc for lists, dicts and dotted names)."""
    head, _, term = metric.partition(".")
    value: Any = row.get(metric, row.get(head) if term else None)
    if term and isinstance(value, Mapping) and metric not in row:
        value = value.get(term)
    if isinstance(value, Mapping):
        if "total" in value:
            return _number(value["total"])
        value = list(value.values())
    if isinstance(value, list):
        numbers = [n for n in (_number(v) for v in value) if n is not None]
        if not numbers:
            return None
        return sum(numbers) if metric.endswith("_tok_s") else sum(numbers) / len(numbers)
    return _number(value)


def metric_series(rows: Iterable[Mapping[str, Any]], metric: str) -> list[tuple[int, float]]:
    """(step, value) pairs for the rows that carry `metric` and a step, in file order."""
    series: list[tuple[int, float]] = []
    for index, row in enumerate(rows):
        value = metric_value(row, metric)
        if value is None:
            continue
        step = row.get("step")
        series.append((int(step) if isinstance(step, (int, float)) else index, value))
    return series


def metric_names(rows: Iterable[Mapping[str, Any]]) -> set[str]:
    """Every plottable metric name present in the rows (for the 'metrics found' hint)."""
    names: set[str] = set()
    for row in rows:
        names.update(key for key in row if key != "step" and metric_value(row, key) is not None)
    return names


def best_value(series: list[tuple[int, float]], metric: str) -> float | None:
    """Best value of a series: max for tau_sim/throughput, min for losses (names containing 'loss')."""
    if not series:
        return None
    higher = HIGHER_IS_BETTER.get(metric.partition(".")[0], "loss" not in metric)
    values = [value for _, value in series]
    return max(values) if higher else min(values)


def run_dir_of(run: RunRecord, runs_root: Path | None, local_roots: Mapping[str, Path] | None = None) -> Path | None:
    """Local directory holding the run's files, first that applies: `<runs_root>/<name>` when given; the
    run_dir recorded in `extra` when it exists on this machine; `<local_roots[target]>/<name>` for runs of a
    local target (its workspace's runs/ folder). None when the files live on a remote target."""
    if runs_root is not None:
        return runs_root / run.name
    recorded = run.extra.get("run_dir")
    if isinstance(recorded, str) and Path(recorded).is_dir():
        return Path(recorded)
    root = (local_roots or {}).get(run.target)
    if root is not None and (root / run.name).is_dir():
        return root / run.name
    return None


def import_dict_from_status(status: Mapping[str, Any], target: str) -> dict[str, Any] | None:
    """What `LineageDB.import_run_json` should receive for one entry of the agent's `status` answer:
    run.json plus the derived state, exit code and last step. None when the run has no run.json."""
    run_json = status.get("run_json") or {}
    if not run_json:
        return None
    data = dict(run_json)
    data.setdefault("name", status.get("name"))
    data.setdefault("target", target)
    data["state"] = AGENT_STATE_TO_LINEAGE.get(str(status.get("state")), "crashed")
    data["exit_code"] = status.get("exit_code")
    if isinstance(status.get("step"), int):
        data["last_step"] = status["step"]
    if status.get("run_dir"):
        data.setdefault("run_dir", status["run_dir"])
    extra = dict(data.get("extra") or {})
    node_targets = extra.get("node_targets") or []
    if len(node_targets) >= 2 and "nodes" not in extra:  # node 0 of a run on several targets: the row lists them
        extra["nodes"] = [{"rank": rank, "target": name} for rank, name in enumerate(node_targets)]
        data["extra"] = extra
    return data


def other_node(status: Mapping[str, Any]) -> int | None:
    """The node number of a run directory that belongs to node 1, 2, ... of a run on several targets (its
    lineage row is node 0's), else None."""
    node = ((status.get("run_json") or {}).get("extra") or {}).get("node")
    return node if isinstance(node, int) and node > 0 else None
