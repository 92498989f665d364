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

Made once per machine, on first use, in the user's cache (`~/.cache/dflashops/speculators-<version>-py<X.Y>-torch
<version>/`, or under $XDG_CACHE_HOME), under a file lock; `.complete` (naming speculators' and our torch's
versions) is written last, and an environment without it is rebuilt. Shared by every clone of this repository on
the machine: the environment does not name our venv; its `.pth` line appends the site-packages that
$DFLASHOPS_BASE_SITE names when the interpreter starts (`speculators_env()` sets it to the running venv's), so a
fresh clone's first `make test` does not build it again. pip writes no bytecode for it (--no-compile: the test
imports a small part of the ~430 MB, and the first import writes what it uses). Measured on the 2-core test
machine: 95 s with an empty pip cache (~130 MB of downloads: transformers, datasets with pyarrow and pandas,
openai, ...), 13 s with a warm one (23 s compiling everything); later runs and clones reuse it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
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


# The environment's `.pth` line: our venv's site-packages after its own, named at each start by the caller (a plain
# path, as a .pth path line would add it: our own .pth files, the editable install's, stay out).
BASE_SITE_VARIABLE = "DFLASHOPS_BASE_SITE"
_BASE_SITE_PTH = (
    f"import os, sys; p = os.environ.get({BASE_SITE_VARIABLE!r}); p and p not in sys.path and sys.path.append(p)\n"
)


def environment_dir() -> Path:
    """Where the environment lives: the user's cache, one per speculators version, Python minor and torch build."""
    import torch

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return cache / "dflashops" / f"speculators-{SPECULATORS_VERSION}-py{python}-torch{torch.__version__}"


def speculators_env() -> dict[str, str]:
    """The environment variables to run the environment's python with: ours, plus where our packages are."""
    return {**os.environ, BASE_SITE_VARIABLE: sysconfig.get_paths()["purelib"]}


def _run(argv: list[str], log: Path) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, env=speculators_env())
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
    (Path(purelib) / "zz_dflashops_venv.pth").write_text(_BASE_SITE_PTH)
    constraints = env / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")  # 2.13.0 matches 2.13.0+cpu too
    log = env / "install.log"
    pip = [str(python), "-m", "pip", "install", "--no-compile", "--disable-pip-version-check", "-c", str(constraints)]
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
