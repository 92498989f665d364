"""Runs on one target: deploy, launch, restart, stop/status/logs (control), the start wait, attach, the supervisor."""
