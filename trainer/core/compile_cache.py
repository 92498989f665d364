"""Where compiled work is kept: one cache per machine kind, shared by every code version.

torch.compile's caches are content-addressed by torch itself: Inductor's FX graph cache and the AOTAutograd
cache key each entry by the traced graph, its inputs and settings, and torch's own source; Triton keys each
kernel by its source, Triton's version and the GPU architecture. So a cache shared across code versions never
serves stale work: an edit to the drafter's forward changes the traced graph and compiles anew, while every
graph the edit did not touch (and every graph of an edit outside the compiled code) is a hit. A cache per code
version, as before, compiled everything cold after every edit (bench/results/restart.md 2026-12-02 "The edit -> restart loop through the CLI":
39.7 s of a 46.9 s restart).

`TRAINER_COMPILE_CACHE_ROOT` (dflashops sets it to `<workspace>/cache/compile`) names the root; the run's
cache is `<root>/<key>`, the key naming what makes compiled work reusable at all: Python, torch and Triton
versions and the GPU (name and compute capability; `cpu` without one). A TORCHINDUCTOR_CACHE_DIR set by hand
wins (trainer.core.process_start.CACHE_DIR_SET_BY_HAND: torch sets the variable itself to its default the first time anything asks).
Inductor reads the variable each time it needs its cache, so setting it before the first compile is enough.

Portable warm starts: `save_artifacts` writes torch's cache artifacts (torch.compiler.save_cache_artifacts:
the FX graph, AOTAutograd and Triton entries this process used) to a new file of `<root>/<key>.artifacts.d/`
(the newest few kept); `load_artifacts` puts them all, carried to a fresh workspace or another node of the same
kind, into an empty cache before the first compile.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT_ENV = "TRAINER_COMPILE_CACHE_ROOT"
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_key(device: torch.device | None = None) -> str:
    """`py3.12-torch2.11.0-triton3.6.0-nvidia_h200-sm90` (or `...-cpu`): what a compiled entry depends on
    beyond its own content. Reads the device's properties (the caller's CUDA context exists by then)."""
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:  # noqa: BLE001 - no triton (a CPU build): inductor compiles C++ only
        triton = "none"
    gpu = "cpu"
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name}-sm{props.major}{props.minor}"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = f"py{python}-torch{torch.__version__}-triton{triton}-{gpu}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key).lower()


def choose(device: torch.device | None = None) -> Path | None:
    """Point Inductor at `<root>/<key>` (and return it) when TRAINER_COMPILE_CACHE_ROOT is set and no cache
    directory was set by hand; else None (torch's own default, or the hand-set one). Call before the first
    compile."""
    from trainer.core.process_start import CACHE_DIR_SET_BY_HAND

    root = os.environ.get(ROOT_ENV)
    if not root or CACHE_DIR_SET_BY_HAND:
        return None
    path = Path(root) / cache_key(device)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_DIR_ENV] = str(path)
    return path


ARTIFACT_FILES_KEPT = 4  # the newest saves kept: ~20 MB each at the 8B shape (bench/results/restart.md 2026-12-02 "The edit -> restart loop through the CLI")


def artifacts_folder(cache: Path) -> Path:
    """`<root>/<key>.artifacts.d/`: one file per run that compiled new work, newest kept."""
    return cache.parent / f"{cache.name}.artifacts.d"


def artifact_files(cache: Path) -> list[Path]:
    """The saved artifacts of this cache, oldest first (a single `<key>.artifacts` of an older trainer first)."""
    legacy = cache.parent / f"{cache.name}.artifacts"
    folder = artifacts_folder(cache)
    saved = sorted(folder.glob("*.bin")) if folder.is_dir() else []
    return ([legacy] if legacy.is_file() else []) + saved


def load_artifacts(cache: Path, warn: Callable[[str], None] | None = None) -> int:
    """Put every saved artifacts file of this kind (from earlier runs, here or elsewhere) into the cache, oldest
    first; the bytes loaded (0: none there). Each save holds only what its own run used, so a file per run that
    compiled new work is kept: a fresh workspace on an older code version finds that version's graphs too.

    A file torch cannot read (cut, overwritten, another torch's format) is moved aside (`quarantine`), with one
    `warn` line: left in place, it failed the same way in every later run of the workspace, and torch's own report
    is a logged traceback that `deploy` reads as a crash. Its graphs are compiled anew; its bytes are not counted."""
    loaded = 0
    for source in artifact_files(cache):
        why: str | None
        try:
            data = source.read_bytes()
        except FileNotFoundError:
            continue  # moved aside by a run of the same workspace meanwhile
        except OSError as exc:
            why = f"cannot be read ({exc.strerror or exc})"
        else:
            why = load_one(data)
            if why is None:
                loaded += len(data)
                continue
        moved = quarantine(source)
        if warn is not None and moved is not None:
            warn(
                f"warning: compile cache: the artifacts file {source} {why}; moved aside to {moved.name}: the "
                "graphs it held are compiled anew"
            )
    return loaded


def load_one(data: bytes) -> str | None:
    """Load one artifacts file's bytes into the cache; None when it loaded, else why not (one phrase). torch
    reports an unreadable file by logging a traceback at warning level (torch.compiler._cache), not by raising:
    that record is caught here and its exception's message becomes the reason."""
    import logging

    caught: list[str] = []

    def catch(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        caught.append(str(exc) if exc is not None else record.getMessage())
        return False  # dropped: the caller reports it in one line

    logger = logging.getLogger("torch.compiler._cache")
    logger.addFilter(catch)
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # noqa: BLE001 - a file that deserialized but does not populate: same verdict
        return f"does not load ({type(exc).__name__}: {exc})"[:300]
    finally:
        logger.removeFilter(catch)
    if info is None and data:
        # torch's message goes on with both checksums' raw bytes: noise in a log line
        reason = caught[-1].split(". Expected:")[0] if caught else "not torch's cache-artifacts format"
        return f"is unreadable ({reason})"[:300]
    return None


QUARANTINE_SUFFIX = ".unreadable"


def quarantine(source: Path) -> Path | None:
    """Rename an unreadable artifacts file to `<name>.unreadable` (no longer an artifacts file, kept for a look;
    the newest ARTIFACT_FILES_KEPT of them stay). None when it is gone already (a concurrent run moved it)."""
    moved = source.with_name(source.name + QUARANTINE_SUFFIX)
    try:
        os.replace(source, moved)
    except FileNotFoundError:
        return None
    for old in sorted(source.parent.glob(f"*{QUARANTINE_SUFFIX}"))[:-ARTIFACT_FILES_KEPT]:
        old.unlink(missing_ok=True)
    return moved


def save_artifacts(cache: Path) -> int:
    """Write the cache artifacts this process used (its hits and its new work) as a new file of
    `<key>.artifacts.d/` (atomically), keeping the newest ARTIFACT_FILES_KEPT; the bytes written."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    folder = artifacts_folder(cache)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}.bin"  # sorts by time of the save
    tmp = folder / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, folder / name)
    for old in sorted(folder.glob("*.bin"))[:-ARTIFACT_FILES_KEPT]:
        old.unlink(missing_ok=True)
    return len(data)


def stats() -> dict[str, int]:
    """This process's compile-cache hits and misses so far (Inductor's FX graph cache, AOTAutograd's cache)."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "fxgraph_hit": int(inductor.get("fxgraph_cache_hit", 0)),
        "fxgraph_miss": int(inductor.get("fxgraph_cache_miss", 0)),
        "autograd_hit": int(aot.get("autograd_cache_hit", 0)),
        "autograd_miss": int(aot.get("autograd_cache_miss", 0)),
    }


def settings_digest() -> dict[str, str]:
    """The process-wide settings that torch's cache keys include beside the graph (matmul precision, TF32,
    determinism, Inductor's and Dynamo's config), as short digests: two processes whose values differ miss each
    other's entries, which is worth seeing when a warm cache compiles anyway."""
    import hashlib

    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    def digest(value: object) -> str:
        return hashlib.sha256(repr(value).encode()).hexdigest()[:10]

    return {
        "matmul": f"{torch.get_float32_matmul_precision()}/tf32={torch.backends.cuda.matmul.allow_tf32}"
        f"/cudnn_tf32={torch.backends.cudnn.allow_tf32}/det={torch.are_deterministic_algorithms_enabled()}",
        "inductor_config": digest(sorted(inductor_config.save_config_portable().items())),
        "dynamo_config": digest(sorted(dynamo_config.save_config_portable().items())),
    }


def describe(cache: Path, counts: dict[str, int]) -> str:
    """One log line: where the compiled work came from."""
    hits, misses = counts["fxgraph_hit"], counts["fxgraph_miss"]
    return f"compile cache {cache}: {hits} graph(s) reused, {misses} compiled"
