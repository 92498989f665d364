"""tmux servers on THIS machine, through libtmux: what the controller asks of tmux itself (the local target's
run sessions before `attach`; tests drive their own terminals with it too, tests/tmux_screen.py).

Inside a target, tmux is driven by the agent with plain `tmux` argv instead: the agent is one stdlib-only file
run by whatever python3 the container has (a bare LXC image has no pip, and nothing may be installed into the
user's environment behind their back), so it cannot import libtmux; docs/architecture.md says more. Every
server here is addressed by its socket name (`-L`): one per workspace, never the user's default server."""

from __future__ import annotations

import shutil

from dflashops.core.errors import TransportError


def local_session_exists(socket: str, session: str) -> bool:
    """Whether the tmux server `socket` on this machine has the session named exactly `session`."""
    if shutil.which("tmux") is None:
        raise TransportError("tmux is not installed on this machine", hint="install tmux (apt-get install tmux)")
    import libtmux  # here: only `attach` of a local run needs it

    server = libtmux.Server(socket_name=socket)
    return server.is_alive() and server.has_session(session, exact=True)
