"""Playbooks: YAML recipes of dflashops steps (restart cycles, sweeps). load (parsing and validation),
vars (templating), expr (the `when`/`until` expressions), steps (what each step kind does), run (the runner).
The public names are re-exported here."""

from dflashops.playbook.load import Playbook, PlaybookError, Step, load_playbook, parse_set, references, render

__all__ = ["PlaybookError", "Playbook", "Step", "load_playbook", "parse_set", "references", "render"]
