"""A real terminal for tests, driven through libtmux: one private tmux server (its own socket name, never the
user's default server) with one session whose pane runs the command under test; read the screen, type keys,
end the server. What a human would see and do, without a human."""

from __future__ import annotations

import os
from pathlib import Path

import libtmux
import libtmux.exc


class Screen:
    def __init__(
        self,
        socket: str,
        command: str,
        *,
        width: int = 120,
        height: int = 30,
        config: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.server = libtmux.Server(socket_name=socket, config_file=str(config) if config else None)
        session = self.server.new_session(
            session_name="screen", window_command=command, x=width, y=height, environment=env
        )
        self.pane = session.active_window.active_pane
        assert self.pane is not None

    def text(self, *, history: int = 0, escapes: bool = False) -> str:
        """What the pane shows now (with `history` lines of scrollback; with `escapes`, the colour codes)."""
        lines = self.pane.capture_pane(start=-history if history else None, escape_sequences=escapes) or []
        return "\n".join(lines)

    def keys(self, keys: str) -> None:
        self.pane.send_keys(keys, enter=False)

    def pid(self) -> int:
        self.pane.refresh()
        return int(self.pane.pane_pid or 0)

    def close(self) -> None:
        if self.server.is_alive():
            self.server.kill()


def kill_server(socket: str) -> None:
    """End the tmux server of `socket` (a workspace's own) and remove its socket file."""
    server = libtmux.Server(socket_name=socket)
    try:
        if server.is_alive():
            server.kill()
    except libtmux.exc.LibTmuxException:  # it exited between the two calls (its last session just ended)
        pass
    tmpdir = Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}"
    (tmpdir / socket).unlink(missing_ok=True)


def session_names(socket: str) -> list[str]:
    server = libtmux.Server(socket_name=socket)
    return sorted(str(session.session_name) for session in server.sessions) if server.is_alive() else []
