"""A Python that imports vLLM's `speculators` (SPECULATORS_VERSION) next to this project's own torch, for the
test that loads our speculators-form export with speculators' own loader (test_export_speculators.py).

Why a second environment: speculators 0.9.0 pins `transformers<=5.19.0` (ours is newer) and wants torchvision and
torchaudio, which it never imports for DFlash. Why not a whole second venv: a second torch is ~700 MB and, from
PyPI on Linux, a CUDA build. So the environment is a venv without pip whose site-packages come first and whose
`.pth` file then adds this venv's site-packages: it sees our torch (and pip), and its own transformers 5.19 and
speculators' other dependencies shadow ours. pip installs speculators itself with --no-deps, then its declared
runtime requirements minus torch, torchvision and torchaudio, under a constraint that pins torch to ours, so no
resolution can replace it. pip never removes a package outside the environment it installs into, so this venv's
packages are left alone.

Made once, on first use, at `<this venv>/speculators-<version>/` (`make clean` removes it with .venv), under a
file lock; `.complete` (naming speculators' and our torch's versions) is written last, and an environment without
it, or made for another torch, is rebuilt. Measured on the 2-core test machine: 95 s with an empty pip cache
(~130 MB of downloads: transformers, datasets with pyarrow and pandas, openai, ...; 430 MB installed), 30 s with
a warm one; later sessions reuse it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SPECULATORS_VERSION = "0.9.0"
# speculators' requirements that the DFlash model never imports and that would bring a second torch stack.
LEFT_OUT = {"torch", "torchvision", "torchaudio"}

# Reads speculators' own declared runtime requirements (no extras) inside the new environment.
_REQUIREMENTS = """
import importlib.metadata, sys
from packaging.requirements import Requirement
left_out = set(sys.argv[1].split(","))
for line in importlib.metadata.requires("speculators") or []:
    req = Requirement(line)
    if req.marker is not None and "extra" in str(req.marker):
        continue
    if req.marker is not None and not req.marker.evaluate():
        continue
    if req.name.lower() not in left_out:
        print(f"{req.name}{req.specifier}")
"""


def environment_dir() -> Path:
    """Where the environment lives: inside the venv running the tests, else the temporary directory."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / f"speculators-{SPECULATORS_VERSION}"
    return Path(tempfile.gettempdir()) / f"dflashops-speculators-{SPECULATORS_VERSION}-{os.getuid()}"


def _run(argv: list[str], log: Path) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    with log.open("a") as handle:
        handle.write(f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise RuntimeError(f"building the speculators test environment failed ({log}):\n$ {' '.join(argv)}\n{tail}")
    return done.stdout


def _build(env: Path) -> None:
    import torch

    shutil.rmtree(env, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Appended after the environment's own site-packages: ours are the fallback, its own packages win.
    (Path(purelib) / "zz_dflashops_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    constraints = env / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")  # 2.13.0 matches 2.13.0+cpu too
    log = env / "install.log"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints)]
    _run([*pip, "--no-deps", f"speculators=={SPECULATORS_VERSION}"], log)
    wanted = _run([str(python), "-c", _REQUIREMENTS, ",".join(sorted(LEFT_OUT))], log).split()
    _run([*pip, *wanted], log)
    _run([str(python), "-c", "import speculators.models.dflash"], log)
    (env / ".complete").write_text(_stamp())


def _stamp() -> str:
    import torch

    return f"speculators {SPECULATORS_VERSION} torch {torch.__version__}\n"


def speculators_python() -> Path:
    """The interpreter of the environment, built first if absent or incomplete (RuntimeError names the log)."""
    env = environment_dir()
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; a concurrent test session waits and then reuses it
        stamp = env / ".complete"
        if not stamp.is_file() or stamp.read_text() != _stamp():
            _build(env)
    return env / "bin" / "python"
