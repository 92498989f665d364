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

from trainer.core import compile_cache

pytestmark = pytest.mark.slow

RUN = """\
import json, sys, torch
from trainer.core import compile_cache

body, saves = sys.argv[1], int(sys.argv[2])
cache = compile_cache.choose(torch.device("cpu"))
loaded = compile_cache.load_artifacts(cache) if not any(cache.iterdir()) else 0
exec(f"def scale(x):\\n    return {body}\\n")
out = torch.compile(scale)(torch.arange(4.0).reshape(2, 2))  # noqa: F821 - defined by the exec above
counts = compile_cache.stats()
for _ in range(saves if counts["fxgraph_miss"] else 0):  # as trainer.training.loop: only a run that compiled new work
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


def train(root: Path, run_dir: Path) -> tuple[subprocess.CompletedProcess[str], str]:
    """The real trainer, tiny preset, two steps, with the compile cache under `root` (as dflashops sets it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env[compile_cache.ROOT_ENV] = str(root)
    argv = [sys.executable, "-m", "trainer", "train", "--preset", "tiny", "--output-dir", str(run_dir)]
    argv += ["--max-steps", "2", "--wandb", "off", "--synthetic-samples", "16"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    return done, done.stdout + done.stderr


def test_an_unreadable_artifacts_file_is_moved_aside_with_one_warning_and_the_run_starts_cold(tmp_path: Path) -> None:
    """Issue 45 item 3: 5,000 random bytes in `<key>.artifacts.d/...bin`. torch logged a traceback ("checksum
    does not match") that `deploy` read as a crash, the log claimed the cache "started from 5000 bytes", and the
    file stayed, so every later run of the workspace failed the same way."""
    root = tmp_path / "compile"
    cache = root / compile_cache.cache_key(None)
    folder = compile_cache.artifacts_folder(cache)
    folder.mkdir(parents=True)
    bad = folder / "00000000000000000001-1.bin"
    bad.write_bytes(os.urandom(5000))
    done, log = train(root, tmp_path / "r1")
    assert done.returncode == 0, log[-3000:]
    warnings = [line for line in log.splitlines() if "moved aside" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: compile cache: "), log[-3000:]
    assert str(bad) in warnings[0] and "checksum does not match" in warnings[0], warnings
    assert "Traceback" not in log and "started from" not in log, log[-3000:]  # nothing false, no torch trace
    assert not bad.exists() and (folder / (bad.name + compile_cache.QUARANTINE_SUFFIX)).is_file()
    # The next run of the workspace (its cache emptied again, so it reads the artifacts again) is not hurt.
    shutil.rmtree(cache)
    done, log = train(root, tmp_path / "r2")
    assert done.returncode == 0 and "moved aside" not in log and "Traceback" not in log, log[-3000:]


def test_a_good_file_beside_an_unreadable_one_still_loads_and_only_its_bytes_count(tmp_path: Path) -> None:
    here = tmp_path / "here"
    compile_in(here, "x @ x")  # one good save
    (cache,) = [p for p in here.iterdir() if p.is_dir() and not p.name.endswith(".d")]
    (good,) = compile_cache.artifact_files(cache)
    (compile_cache.artifacts_folder(cache) / "99999999999999999999-1.bin").write_bytes(os.urandom(5000))
    shutil.rmtree(cache)
    run = compile_in(here, "x @ x", saves=0)
    assert run["loaded"] == good.stat().st_size and run["fxgraph_hit"] >= 1 and run["fxgraph_miss"] == 0, run
    assert compile_cache.artifact_files(cache) == [good]


CACHE_REPORT = """\
import json, sys, torch
from pathlib import Path
from trainer.core import compile_cache
from trainer.training.loop import CacheReport
from trainer.state.metrics import RunRecorder

run_dir = Path(sys.argv[1])
cache = compile_cache.choose(torch.device("cpu"))
recorder = RunRecorder(run_dir, 2, metrics=False)
report = CacheReport(cache, recorder, saves=True)
report.update()  # after a warm-up that compiled nothing (--target-compile on, CPU)
before = json.loads((run_dir / "status.json").read_text())["compile_cache"]
torch.compile(lambda x: x @ x)(torch.ones(2, 2))  # what the first step compiles
report.update()  # after the first step
after = json.loads((run_dir / "status.json").read_text())["compile_cache"]
print(json.dumps({"before": before, "after": after, "saved": len(compile_cache.artifact_files(cache))}))
"""


def test_the_status_counters_count_what_compiles_after_the_warm_up(tmp_path: Path) -> None:
    """Issue 45 item 3: status.json read 0 hits and 0 misses in runs that reused the cache (`--target-compile on`
    on the CPU: the target compiles at its first call, after the one report that was taken)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env[compile_cache.ROOT_ENV] = str(tmp_path / "compile")
    counts = []
    for name in ("cold", "warm"):
        (tmp_path / name).mkdir()
        done = subprocess.run(
            [sys.executable, "-c", CACHE_REPORT, str(tmp_path / name)],
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = counts
    assert cold["before"]["fxgraph_miss"] == 0 and cold["after"]["fxgraph_miss"] >= 1 and cold["saved"] == 1, cold
    assert warm["after"]["fxgraph_hit"] >= 1 and warm["after"]["fxgraph_miss"] == 0 and warm["saved"] == 1, warm
