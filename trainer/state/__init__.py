"""What a run leaves on disk and hands on: checkpoints, metrics, failure reports, the hand-over."""
