"""The agent's entry: `python3 agent-<sha12>.pyz VERB ...` (the zipapp's own __main__ calls `main` here),
`python3 -m dflashops.agent VERB ...`, or `python3 <checkout>/dflashops/agent VERB ...` (the folder itself, which
the agent uses to start itself again when it runs from a checkout: core.program)."""

import os
import sys

if not __package__:  # run as a folder: sys.path[0] is this folder; the package lives two levels up
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflashops.agent.core import main  # after the path above is set

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
