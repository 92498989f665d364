"""Many targets: a job on several targets (nodes) and a verb over a group (fanout)."""
