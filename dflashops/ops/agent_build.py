"""The agent as ONE file: a zipapp built in memory from the package dflashops/agent/, deterministically.

The same sources give the same bytes (so the content-addressed name `agent-<sha12>.pyz` names one version):
the package's `*.py` files in sorted order, each stored (not deflated: zlib's output may differ between the
zlib versions of two controllers, and ~210 KB travel once per version) with a fixed timestamp (1980-01-01,
zip's earliest) and mode 0644, no __pycache__, no directory entries. Beside them an empty `dflashops/__init__.py`
(the controller's own is not the agent's to ship) and the zipapp's `__main__.py`, which calls
`dflashops.agent.__main__.main`. Cost: reading the package's 18 files and writing ~210 KB (210,101 bytes) to
memory, ~0.7 ms, 1.3 ms the first time in a process (2026-12-06, the 2-core CPU machine at load average 7).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "agent"
ARC_ROOT = "dflashops/agent"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
MODE = 0o100644  # a regular file, rw-r--r--
ENTRY = b"import sys\n\nfrom dflashops.agent.__main__ import main\n\nsys.exit(main(sys.argv[1:]))\n"


def package_files(package: Path = PACKAGE) -> dict[str, Path]:
    """arcname -> local file: every module of the package (flat: the agent has no subpackages), sorted."""
    return {f"{ARC_ROOT}/{path.name}": path for path in sorted(package.glob("*.py"))}


def build_zipapp(package: Path = PACKAGE) -> bytes:
    """The zipapp's bytes; equal for equal sources, whatever the files' times, modes or the build's clock."""
    members = {"__main__.py": ENTRY, "dflashops/__init__.py": b""}
    members |= {arcname: path.read_bytes() for arcname, path in package_files(package).items()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for arcname in sorted(members):
            info = zipfile.ZipInfo(arcname, date_time=ZIP_EPOCH)
            info.external_attr = MODE << 16
            info.create_system = 3  # unix, so that the mode above is read as one (the default depends on the OS)
            archive.writestr(info, members[arcname])
    return buffer.getvalue()
