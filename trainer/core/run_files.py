"""The names the trainer writes in its run directory (`--output-dir`): its share of docs/run-directory.md.

The one list of every name in a run directory is `RUN_FILES` in dflashops/agent/common.py. The trainer never imports
dflashops, so it spells its own names here, and only here; tests/test_run_directory_contract.py checks that they
are exactly the rows that list says the trainer writes.
"""

from __future__ import annotations

STATUS = "status.json"  # phase, step, heartbeat, pid, exit code: trainer.state.metrics.RunRecorder (atomic rewrites)
# Blocks set aside at start for the last status.json on a full disk (overwritten in place, renamed over STATUS).
STATUS_RESERVE = ".status.json.reserved"
METRICS = "metrics.jsonl"  # one JSON object per log step: trainer.state.metrics.RunRecorder.log
TRAIN_CONFIG = "train_config.json"  # the run's TrainConfig, written at the start: trainer.state.metrics.RunRecorder
CHECKPOINTS = "checkpoints"  # a folder of CHECKPOINT_PREFIX + six-digit step folders: trainer.state.checkpoint
CHECKPOINT_PREFIX = "step_"  # checkpoints/step_000120/: zero-padded, so names sort in step order

# As RUN_FILES writes them (a folder ends in "/").
NAMES = (STATUS, STATUS_RESERVE, METRICS, TRAIN_CONFIG, CHECKPOINTS + "/")
