"""Run lineage: which run came from which, with what change (records in SQLite, mirrored in each run.json).

Modules: db (LineageDB, the SQLite file), sqlite (the connection and its errors), record (RunRecord, states,
redaction), naming (next names, W&B names), diff (argument and setting differences), files (run.json and
metrics files of a run directory). The public names are re-exported here.
"""

from dflashops.lineage.db import SCHEMA_VERSION, LineageDB
from dflashops.lineage.diff import RunDiff, diff_runs, parse_argv
from dflashops.lineage.naming import next_name, wandb_env
from dflashops.lineage.record import STATES, RunRecord, record_from_run_json, redact_argv, redact_env
from dflashops.lineage.sqlite import LineageDBError

__all__ = [
    "SCHEMA_VERSION",
    "STATES",
    "LineageDB",
    "LineageDBError",
    "RunDiff",
    "RunRecord",
    "diff_runs",
    "next_name",
    "parse_argv",
    "record_from_run_json",
    "redact_argv",
    "redact_env",
    "wandb_env",
]
