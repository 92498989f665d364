"""Bringing a run's files to this machine: fetch (what to bring) and fetch_file (one file, resumable)."""
