"""The state of a run on several targets as one entry (`overall`): a pure function of the nodes' status entries,
kept apart from ops/runs/nodes.py so that the observer (ops/runs/observer.py), which nodes.py calls, can use it
without an import circle."""

from __future__ import annotations

from typing import Any


def overall(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry for a whole run: itself for one node; for several, node 0's with the job's state: running
    while any node runs, else crashed/lost when any node did (with that node's error line), else unreachable
    when a node could not be asked (its state is not known), else node 0's."""
    if len(entries) == 1 or "node" not in entries[0]:
        return entries[0]
    combined = dict(entries[0])
    for state in ("running", "stopping", "launching", "crashed", "lost", "unreachable", "missing"):
        hit = next((entry for entry in entries if entry["state"] == state), None)
        if hit is not None:
            combined.update(
                state=hit["state"] if hit["state"] != "missing" else "lost",
                error_line=hit.get("error_line") or combined.get("error_line"),
                exit_code=hit.get("exit_code") if state in ("crashed", "lost") else combined["exit_code"],
            )
            break
    combined["nodes"] = [
        {
            **{key: entry.get(key) for key in ("node", "target", "state", "exit_code", "step")},
            **({"error": entry["error"]} if "error" in entry else {}),
        }
        for entry in entries
    ]
    return combined
