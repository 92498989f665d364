"""The dflashops agent: the stdlib-only program that runs inside the target with the target's own python3.

It reaches the target as ONE file, a zipapp built from this package (dflashops/ops/agent_build.py):
`python3 <workspace>/.dflashops/agent-<sha12>.pyz VERB [--json-args JSON | --json-stdin]` (the contract:
__main__.py's docstring). The controller imports a few pure definitions from its modules (names, the name rule,
the tmux socket name); importing them starts nothing. Every module here imports only the standard library
and this package (tests/test_boundaries.py); doctor_probe.py is also sent alone (on stdin) and
imports nothing of it; supervisor.py runs from the zipapp (`supervise start`) and imports the agent's modules as
any module of the package does (from that zipapp, never the controller's).
"""
