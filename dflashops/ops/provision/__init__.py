"""`dflashops provision`: Proxmox GPU containers from the inventory's `provision:` blocks.

facts.py reads the host and the container (commands only), plan.py turns desired state + facts into ordered
steps (a pure function), apply.py runs them with a progress line each. docs/provision.md has the config lines.
"""
