"""A run's configuration and its files: the flags, the compile scope and cache, the run folder's names, disk space, log lines and signals. Imports nothing else of the trainer."""
