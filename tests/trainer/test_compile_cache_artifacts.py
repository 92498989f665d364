"""Portable warm starts (issue 28, item 3): every run that compiled new work leaves its cache artifacts beside
the compile cache, and an empty cache (a fresh workspace or container given that folder) starts from all of them,
so it is warm for an older code version too, not only for the last one that compiled. Real torch.compile with
Inductor's CPU backend, each run in its own interpreter (the in-memory caches and counters are per process).

The compiled functions are matrix products only: Inductor lowers them to its extern kernels (aten's mm), so
their FX graphs are cached, saved as artifacts and loaded like any other, but no C++ kernel is generated. An
element-wise body (`x * 2 + 1`) made each of the four interpreters build Inductor's vector-ISA probes and its
kernel with g++ on an empty cache: 11-18 CPU-s each against ~4 (issue 29 item 11). What the test proves is the artifacts' path (which
FX graphs an empty cache finds), the same whatever kernels a graph holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import compile_cache

pytestmark = pytest.mark.slow

RUN = """\
import json, sys, torch
from trainer import compile_cache

body, saves = sys.argv[1], int(sys.argv[2])
cache = compile_cache.choose(torch.device("cpu"))
loaded = compile_cache.load_artifacts(cache) if not any(cache.iterdir()) else 0
exec(f"def scale(x):\\n    return {body}\\n")
out = torch.compile(scale)(torch.arange(4.0).reshape(2, 2))  # noqa: F821 - defined by the exec above
counts = compile_cache.stats()
for _ in range(saves if counts["fxgraph_miss"] else 0):  # as trainer.loop: only a run that compiled new work
    compile_cache.save_artifacts(cache)
print(json.dumps({"out": out.tolist(), "loaded": loaded, **counts}))
"""


def compile_in(root: Path, body: str, saves: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env[compile_cache.ROOT_ENV] = str(root)
    done = subprocess.run(
        [sys.executable, "-c", RUN, body, str(saves)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_empty_cache_starts_warm_for_every_recent_code_version(tmp_path: Path) -> None:
    here = tmp_path / "here"
    first = compile_in(here, "x @ x", saves=compile_cache.ARTIFACT_FILES_KEPT)  # version 1 compiles and saves
    assert first["fxgraph_miss"] >= 1 and first["out"] == [[2.0, 3.0], [6.0, 11.0]]
    (cache,) = [p for p in here.iterdir() if p.is_dir() and not p.name.endswith(".d")]
    shutil.rmtree(cache)  # version 2 starts from an empty cache too: it loads version 1's artifacts ...
    second = compile_in(here, "x.t() @ x")
    assert second["loaded"] > 0 and second["fxgraph_miss"] >= 1  # ... and compiles its own, saved beside them
    saved = compile_cache.artifact_files(cache)  # only the newest kept, version 2's among them
    assert len(saved) == compile_cache.ARTIFACT_FILES_KEPT and saved == sorted(saved), saved
    assert not list(compile_cache.artifacts_folder(cache).glob(".*.tmp"))

    fresh = tmp_path / "fresh"  # a fresh container given only the artifacts folder
    shutil.copytree(compile_cache.artifacts_folder(cache), fresh / compile_cache.artifacts_folder(cache).name)
    for body, out in (("x @ x", [[2.0, 3.0], [6.0, 11.0]]), ("x.t() @ x", [[4.0, 6.0], [6.0, 10.0]])):
        shutil.rmtree(fresh / cache.name, ignore_errors=True)
        run = compile_in(fresh, body, saves=0)
        assert run["out"] == out and run["loaded"] > 0
        assert run["fxgraph_hit"] >= 1 and run["fxgraph_miss"] == 0, (body, run)  # the older version too
