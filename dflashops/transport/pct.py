"""The `pct` transport: commands inside a Proxmox LXC container, through a transport to its host.

Every command becomes `[sudo -n] pct exec CTID --keep-env 0 -- env K=V... argv...` on the host
transport (normally `SshTransport`; `LocalTransport` on the host itself). `--keep-env 0` so the host
user's environment never leaks into the container; the run's environment is passed explicitly.

Before the first command of an invocation, `pct status CTID` is asked once (~1 round trip) so a stopped
or missing container is a clear error naming the container, with Proxmox's own words, instead of a
`pct exec` exit code 255 surfacing later in the middle of a verb. `sudo -n` (never a password prompt:
a prompt over a non-interactive channel would hang) is used when the host user is not root.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from dflashops.core.errors import NotFound, TransportError
from dflashops.core.shell import env_argv
from dflashops.transport.base import StderrSink, Stdin, Transport

STATUS_FAILED = 254
PCT_FAILED = 255  # pct exec's own failures (container not running, no such container)
STATUS_MARK = "dflashops-pct-status-rc="


@dataclass
class PctTransport(Transport):
    """Runs argv inside container `ctid` on the host reached by `host` (see the module docstring)."""

    host: Transport | None = None
    ctid: int = 0
    sudo: bool = False
    _checked: bool = field(default=False, init=False, repr=False)
    _check_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.host is None:
            raise ValueError("PctTransport needs the host transport")
        if not isinstance(self.ctid, int) or not 100 <= self.ctid <= 999_999_999:
            raise ValueError(f"invalid CTID {self.ctid!r}: Proxmox IDs are integers from 100")

    def pct_argv(self, *args: str) -> list[str]:
        return [*(["sudo", "-n"] if self.sudo else []), "pct", *args]

    def exec_argv(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        inner = [*env_argv(env), *argv] if env else list(argv)
        return self.pct_argv("exec", str(self.ctid), "--keep-env", "0", "--", *inner)

    # -- the once-per-invocation container check ----------------------------------------------------
    def ensure_running(self) -> None:
        with self._check_lock:
            if self._checked:
                return
            assert self.host is not None
            code, out, err = self.host._run(self.pct_argv("status", str(self.ctid)), env={}, stdin=None, timeout=60)
            words = (out + err).decode(errors="replace").strip()
            self._raise_for_status(code, words)
            self._checked = True

    def _raise_for_status(self, code: int, words: str) -> None:
        where = f"container {self.ctid} on {self.host.name if self.host else '?'}"
        last = words.splitlines()[-1] if words else f"exit code {code}"
        if code == 0 and "status: running" in words:
            return
        if code == 0 and "status:" in words:
            state = words.split("status:", 1)[1].split()[0]
            raise TransportError(
                f"{where} is {state} (pct status: {last})", hint=f"start it on the host: pct start {self.ctid}"
            )
        if "does not exist" in words:
            raise NotFound(
                f"{where} does not exist: {last}",
                hint="check the CTID in the inventory (`pct list` on the host shows them)",
            )
        if "password is required" in words or "a terminal is required" in words:
            raise TransportError(
                f"sudo on {self.host.name if self.host else '?'} asks for a password: {last}",
                hint="give the host user a NOPASSWD sudo rule for pct, or connect as root",
            )
        if "only root" in words or "permission denied" in words.lower():
            raise TransportError(
                f"pct on {self.host.name if self.host else '?'} needs root: {last}",
                hint="set `sudo: true` for this host in the inventory, or connect as root",
            )
        if code == 127 or "not found" in words:
            raise TransportError(
                f"no `pct` on {self.host.name if self.host else '?'}: {last}",
                hint="not a Proxmox host? use mode `host` (plain server) or `direct`",
            )
        raise TransportError(f"pct status {self.ctid} failed with exit code {code}: {last}")

    # -- Transport ----------------------------------------------------------------------------------
    def _run(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: Stdin, timeout: float | None
    ) -> tuple[int, bytes, bytes]:
        return self._exec(argv, env, stdin, timeout, None)

    def _run_watched(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink,
    ) -> tuple[int, bytes, bytes]:
        return self._exec(argv, env, stdin, timeout, on_stderr)

    def _exec(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdin: Stdin,
        timeout: float | None,
        on_stderr: StderrSink | None,
    ) -> tuple[int, bytes, bytes]:
        host = self.host
        assert host is not None

        def run(host_argv: Sequence[str]) -> tuple[int, bytes, bytes]:
            if on_stderr is None:
                return host._run(host_argv, env={}, stdin=stdin, timeout=timeout)
            return host._run_watched(host_argv, env={}, stdin=stdin, timeout=timeout, on_stderr=on_stderr)

        with self._check_lock:
            checked = self._checked
        if checked:
            code, out, err = run(self.exec_argv(argv, env))
            if code == PCT_FAILED:
                self._raise_if_gone(err)
            return code, out, err
        # First command: `pct status` and `pct exec` chained in ONE host command (one round trip and
        # one ssh channel less, ~0.2-0.5 s per invocation); the exec only runs when status says running.
        code, out, err = run(self.checked_exec_argv(argv, env))
        if (
            code == STATUS_FAILED
            and err.rstrip().splitlines()[-1:]
            and err.rstrip().splitlines()[-1].startswith(STATUS_MARK.encode())
        ):
            lines = err.decode(errors="replace").rstrip().splitlines()
            self._raise_for_status(int(lines[-1].split("=", 1)[1] or 1), "\n".join(lines[:-1]))
        with self._check_lock:
            self._checked = True
        return code, out, err

    def _raise_if_gone(self, err: bytes) -> None:
        """The container stopped or vanished after this invocation's status check (`logs -f` for an hour,
        then `pct stop`): Proxmox's `pct exec` then exits 255 with "CT 200 not running" (or the missing
        config file's words). Say that, instead of the inner command's "no answer"."""
        last = (err.decode(errors="replace").strip().splitlines() or [""])[-1].strip()
        where = f"container {self.ctid} on {self.host.name if self.host else '?'}"
        if re.fullmatch(rf"CT {self.ctid} not running", last):
            raise TransportError(f"{where} is stopped ({last})", hint=f"start it on the host: pct start {self.ctid}")
        if re.search(rf"\b{self.ctid}\.conf' does not exist", last):
            raise NotFound(
                f"{where} does not exist any more ({last})",
                hint="check the CTID in the inventory (`pct list` on the host shows them)",
            )

    def checked_exec_argv(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """`sh -c` on the host: pct status; exec pct exec only if running, else report and exit 254.
        The script is a constant (sudo prefix and the integer CTID only); argv travels as "$@"."""
        status = " ".join([*self.pct_argv("status"), str(int(self.ctid))])
        script = (
            f'st=$({status} 2>&1); rc=$?; case "$st" in *"status: running"*) exec "$@";; esac; '
            f'printf "%s\\n" "$st" >&2; printf "{STATUS_MARK}%s\\n" "$rc" >&2; exit {STATUS_FAILED}'
        )
        return ["sh", "-c", script, "dflashops-pct", *self.exec_argv(argv, env)]

    def stream(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> Iterator[bytes]:
        self.ensure_running()
        assert self.host is not None
        merged = {**self.default_env, **(env or {})}
        return self.host.stream(self.exec_argv(argv, merged), timeout=timeout)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()


def open_remote(target: object, hosts: Mapping[str, object] | None = None) -> Transport:
    """The transport for a `pct`, `direct` or `host` inventory target (duck-typed `Target`):
    pct -> PctTransport over ssh to the Proxmox host; direct (the container runs sshd) and host (a plain
    GPU server) -> ssh straight to `target.host`. The ssh part goes through the host's multiplexer when one
    can run (transport/mux_client.py). Nothing connects until the first command."""
    from dflashops.transport.mux_client import open_ssh
    from dflashops.transport.ssh_settings import settings_for_host

    kind, name, host = getattr(target, "kind"), str(getattr(target, "name")), getattr(target, "host", None)
    if host is None:
        raise TransportError(f"target {name!r} ({kind}) names no host", hint="set `host:` for it in the inventory")
    settings = settings_for_host(host, hosts)
    if kind == "pct":
        ctid = getattr(target, "ctid", None)
        if not isinstance(ctid, int):
            raise TransportError(f"target {name!r} is a pct target without a ctid", hint="set `ctid:` in the inventory")
        return PctTransport(
            name=name,
            default_env={},
            host=open_ssh(str(getattr(host, "name")), settings),
            ctid=ctid,
            sudo=bool(getattr(host, "sudo", False)),
        )
    if kind in ("direct", "host"):
        return open_ssh(name, settings)
    raise TransportError(f"target {name!r} has kind {kind!r}, which is not a remote kind")
