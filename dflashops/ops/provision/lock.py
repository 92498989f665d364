"""One provision at a time per container: a lock folder on the Proxmox host, `/run/lock/dflashops-provision-VMID`.

`mkdir` is atomic, so of two runs that meet exactly one gets it; the other is refused, naming the holder (machine,
pid, start time) instead of racing it through `pct create` and `pct set`. The folder holds the owner line and is
removed by its owner only. A holder that died without removing it (SIGKILL, a lost laptop) is recognised when it
ran on this machine (its pid is gone) and the lock is taken over with a word; from another machine only a person
can tell, and the hint says which folder to remove. /run is a tmpfs: a host reboot clears every lock.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dflashops.core.errors import Conflict, TransportError
from dflashops.transport.base import Transport

LOCK_ROOT = "/run/lock"
# $1: the folder, $2: the owner line. Prints `acquired`, or the holder's owner line.
TAKE = 'if mkdir "$1" 2>/dev/null; then printf "%s\\n" "$2" > "$1/owner"; echo acquired; else cat "$1/owner"; fi'
# Removes the folder only while it still holds this owner line (a taken-over lock is not ours to remove).
GIVE = '[ "$(cat "$1/owner" 2>/dev/null)" = "$2" ] && rm -rf "$1"; true'


def lock_path(vmid: int) -> str:
    return f"{LOCK_ROOT}/dflashops-provision-{int(vmid)}"


def _stale(owner: str) -> bool:
    """The holder ran on this machine and its process is gone."""
    parts = owner.split()
    if len(parts) < 3 or parts[0] != socket.gethostname() or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextmanager
def provision_lock(host: Transport, vmid: int, progress: Callable[[str], None]) -> Iterator[None]:
    path = lock_path(vmid)
    owner = f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    for attempt in range(2):
        result = host.run(["sh", "-c", TAKE, "dflashops-lock", path, owner], check=False, timeout=60)
        said = result.stdout.strip()
        if result.ok and said == "acquired":
            break
        if not result.ok:
            last = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
            raise TransportError(f"could not take the provision lock {path} on {host.name}: {last}")
        if attempt == 0 and _stale(said):
            progress(f"the provision lock of {said} is stale (that process has ended): taking it over")
            host.run(["sh", "-c", GIVE, "dflashops-lock", path, said], check=False, timeout=60)
            continue
        raise Conflict(
            f"container {vmid} on {host.name} is being provisioned by another run ({said or 'owner unknown'})",
            hint=f"wait for it to end; if that run is gone for good, remove {path} on {host.name}",
        )
    try:
        yield
    finally:
        host.run(["sh", "-c", GIVE, "dflashops-lock", path, owner], check=False, timeout=60)
