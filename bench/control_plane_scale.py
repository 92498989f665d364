"""The control plane after weeks of use (issue 47): 1,000 runs, 10,000 lineage records, restart chains 10,000
deep. Each measure runs main's code ("before", `git archive main` in the scratch folder) and this checkout's
("after") on the same scale in one run, and prints one line per figure with the load average beside it.

    .venv/bin/python bench/control_plane_scale.py status   [--runs 1000 --processes 300]
    .venv/bin/python bench/control_plane_scale.py lineage  [--records 10000]
    .venv/bin/python bench/control_plane_scale.py sync     [--runs 1000]
    .venv/bin/python bench/control_plane_scale.py release  [--release-mb 200]
    .venv/bin/python bench/control_plane_scale.py all

The scale is built in a scratch folder outside the repository (--workdir, default a new temporary one, removed
at the end unless --keep): fake run directories (run.json, marker, a pgid of a group that is gone, exit_code,
a 400-row metrics.jsonl, a train.log, status.json), lineage records written straight into a LineageDB file
(flat: 10,000 roots; chain: one restart chain 10,000 generations deep), and `sleep` processes up to
--processes live processes on the machine. Every figure is the median of --repeat runs of a fresh process
(`python -m dflashops.cli.main ...` or the agent's verb in a child interpreter), wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
TIMEOUT_S = 600


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main_code(workdir: Path, ref: str) -> Path:
    """`ref`'s dflashops package, unpacked in the scratch folder (the "before" code)."""
    target = workdir / f"code-{ref}"
    if not target.is_dir():
        target.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "dflashops"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def timed(code: Path, argv: list[str], repeat: int, stdin: bytes | None = None) -> tuple[float, int, str]:
    """(median seconds, bytes of stdout, last stderr line or the error) of `python ARGV` with `code` first on the
    path, run `repeat` times."""
    env = {**os.environ, "PYTHONPATH": str(code), "NO_COLOR": "1", "COLUMNS": "160"}
    times, size, note = [], 0, ""
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [PYTHON, *argv], env=env, cwd=code, capture_output=True, timeout=TIMEOUT_S, input=stdin
            )
        except subprocess.TimeoutExpired:
            return float("nan"), 0, f"timed out after {TIMEOUT_S} s"
        times.append(time.perf_counter() - start)
        size = len(done.stdout)
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        note = lines[-1][:100] if done.returncode and lines else f"exit {done.returncode}" if done.returncode else ""
    return statistics.median(times), size, note


def report(measure: str, label: str, seconds: float, size: int, note: str) -> None:
    print(f"{measure:<44} {label:<7} {seconds:8.3f} s  {size:>10} B stdout  {load()}  {note}", flush=True)


# ------------------------------------------------------------------------------------------------ scale
def make_runs(workspace: Path, count: int, metrics_rows: int = 400) -> None:
    """`count` finished run directories in `workspace/runs` (pgid of a group that no longer exists)."""
    runs = workspace / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    row = {"loss": 2.5, "tau_sim": 1.5, "block_tok_s": [5100.0, 4980.0], "lr": 3e-4}
    metrics = "".join(json.dumps({**row, "step": step}) + "\n" for step in range(metrics_rows))
    log = "".join(f"step {step} loss 2.5 tau_sim 1.5\n" for step in range(2000))
    for index in range(count):
        directory = runs / f"r{index:05d}"
        directory.mkdir(exist_ok=True)
        started = f"2026-11-{1 + index % 28:02d}T{index % 24:02d}:00:00Z"
        run_json = {"name": directory.name, "parent": f"r{index - 1:05d}" if index else None, "target": "local",
                    "launcher": "nohup", "started_at": started, "argv": ["python", "-m", "trainer", "train"],
                    "env": {"WANDB_PROJECT": "p"}, "note": "bench", "state": "finished"}  # fmt: skip
        (directory / "run.json").write_text(json.dumps(run_json))
        (directory / "marker").write_text(f"{directory.name}.{index:08x}\n")
        (directory / "pgid").write_text(f"{4_000_000 + index}\n")  # above pid_max's default: never a live group
        (directory / "exit_code").write_text("0\n")
        if index < count - 5:  # all but the last 5 ended weeks ago
            os.utime(directory / "exit_code", (time.time() - 86400 * (30 - index % 28),) * 2)
        (directory / "metrics.jsonl").write_text(metrics)
        (directory / "train.log").write_text(log)
        (directory / "status.json").write_text(json.dumps({"step": metrics_rows - 1, "phase": "done"}))


@contextmanager
def processes(total: int) -> Iterator[int]:
    """`sleep` processes until /proc lists `total` live processes (or none when there are that many)."""
    have = sum(1 for entry in os.listdir("/proc") if entry.isdigit())
    started = [subprocess.Popen(["sleep", "3600"]) for _ in range(max(0, total - have))]
    try:
        yield sum(1 for entry in os.listdir("/proc") if entry.isdigit())
    finally:
        for process in started:
            process.kill()
            process.wait()


AGENT_STATUS = """
import json, sys, time
from dflashops.agent.protocol import parse
from dflashops.agent.status import verb_status
request = parse("status", {"workspace": sys.argv[1], **json.loads(sys.argv[2])})
start = time.perf_counter()
answer = verb_status(request)
print(json.dumps({"seconds": time.perf_counter() - start, "runs": len(answer["runs"])}))
"""


def bench_status(args: argparse.Namespace, workdir: Path, codes: dict[str, Path]) -> None:
    workspace = workdir / "status-ws"
    make_runs(workspace, args.runs)
    with processes(args.processes) as live:
        print(f"# status: {args.runs} run directories, {live} processes in /proc", flush=True)
        for label, code in codes.items():
            for request in ({}, {"ended_within_s": 86400}):
                seconds: list[float] = []
                for _ in range(args.repeat):
                    env = {**os.environ, "PYTHONPATH": str(code)}
                    done = subprocess.run([PYTHON, "-c", AGENT_STATUS, str(workspace), json.dumps(request)], env=env,
                                          cwd=code, capture_output=True, text=True, check=True, timeout=TIMEOUT_S)  # fmt: skip
                    seconds.append(json.loads(done.stdout)["seconds"])
                    shown = json.loads(done.stdout)["runs"]
                what = "every run" if not request else "ended_within_s 1 day"
                report(f"agent verb_status, {args.runs} runs, {what}", label, statistics.median(seconds), 0,
                       f"in-process, {shown} runs answered")  # fmt: skip
            inventory = write_inventory(workdir, workspace)
            for argv in (["status"], ["status", "--all-runs"], ["status", "--json"]):
                if label == "before" and "--all-runs" in argv:
                    continue
                result = timed(code, ["-m", "dflashops.cli.main", "--inventory", str(inventory), *argv], args.repeat)
                report(f"dflashops {' '.join(argv)}", label, *result)
            for argv in (["runs", "list"], ["runs", "tree"]):
                result = timed(code, ["-m", "dflashops.cli.main", *argv, "--db", str(workdir / "status.sqlite")],
                               args.repeat)  # fmt: skip
                report(f"dflashops {' '.join(argv)} ({args.runs} local runs)", label, *result)


def write_inventory(workdir: Path, workspace: Path) -> Path:
    inventory = workdir / "inventory.yaml"
    inventory.write_text(f"targets:\n  local:\n    kind: local\n    workspace: {workspace}\nprofiles: {{}}\n")
    db = workdir / "status.sqlite"
    if not db.exists():
        subprocess.run([PYTHON, "-m", "dflashops.cli.main", "runs", "sync", "--workspace", str(workspace), "--db",
                        str(db)], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, check=True)  # fmt: skip
    return inventory


FILL_LINEAGE = """
import sys
from dflashops.lineage import LineageDB, RunRecord
path, count, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
db = LineageDB(path)
with db._write():  # one transaction: the scale, not the cost of writing it, is what is measured
    for i in range(count):
        parent = (f"r{i - 1:05d}" if i else None) if shape == "chain" else None
        db._insert(RunRecord(
            name=f"r{i:05d}", parent=parent, note=f"hypothesis {i}: try a larger lr", code_hash="ab" * 20,
            argv=["python", "-m", "trainer", "train", "--lr", str(i), "--hf-token", "hf_abcdefghijklmnop"],
            env={"WANDB_PROJECT": "p", "HF_TOKEN": "hf_abcdefghijklmnop", "WANDB_NAME": f"r{i:05d}"},
            target="gpu-box", started_at=f"2026-{1 + i // 2800:02d}-{1 + i // 100 % 28:02d}T{i % 24:02d}:{i % 60:02d}:00Z",
            state="finished", exit_code=0, last_step=1000 + i, extra={"run_dir": f"/ws/runs/r{i:05d}"}))
"""


def bench_lineage(args: argparse.Namespace, workdir: Path, codes: dict[str, Path]) -> None:
    for shape in ("flat", "chain"):
        db = workdir / f"lineage-{shape}.sqlite"
        subprocess.run([PYTHON, "-c", FILL_LINEAGE, str(db), str(args.records), shape],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
        print(f"# lineage: {args.records} records, {shape}", flush=True)
        last = f"r{args.records - 1:05d}"
        for argv in (["list"], ["list", "--json"], ["list", "--limit", "50"], ["list", "--page", "3"],
                     ["list", "--all"], ["tree"], ["tree", last], ["export"], ["export", "--json"]):  # fmt: skip
            for label, code in codes.items():
                if label == "before" and any(flag in argv for flag in ("--limit", "--page", "--all")):
                    continue
                result = timed(code, ["-m", "dflashops.cli.main", "runs", *argv, "--db", str(db)], args.repeat)
                report(f"runs {' '.join(argv)} ({shape})", label, *result)


def bench_sync(args: argparse.Namespace, workdir: Path, codes: dict[str, Path]) -> None:
    workspace = workdir / "sync-ws"
    make_runs(workspace, args.runs, metrics_rows=20)
    print(f"# sync: {args.runs} run directories", flush=True)
    for label, code in codes.items():
        db = workdir / f"sync-{label}.sqlite"
        argv = ["-m", "dflashops.cli.main", "runs", "sync", "--workspace", str(workspace), "--db", str(db)]
        result = timed(code, argv, 1)
        report(f"runs sync --workspace, {args.runs} runs (new db)", label, *result)
        result = timed(code, argv, args.repeat)
        report(f"runs sync --workspace, {args.runs} runs (unchanged)", label, *result)


RELEASE_INVENTORY = """\
targets:
  local:
    kind: local
    workspace: ws
    python: {python}
profiles:
  big:
    argv: ["{{python}}", "-c", "import time; time.sleep(30)"]
    files: [big.bin, small.py]
    packages: []
  small:
    argv: ["{{python}}", "-c", "import time; time.sleep(30)"]
    files: [small.py]
    packages: []
"""


def bench_release(args: argparse.Namespace, workdir: Path, codes: dict[str, Path]) -> None:
    """`deploy --detach` to the local target (the agent over the local transport: 0 ms RTT) of a profile with
    a --release-mb random file and of the same profile without it: first, unchanged, small change."""
    big = workdir / "release-src" / "big.bin"
    big.parent.mkdir(parents=True, exist_ok=True)
    with big.open("wb") as handle:
        for _ in range(args.release_mb):
            handle.write(os.urandom(1 << 20))
    old = time.time() - 3600  # written an hour ago, as a data file of a real tree (the cache keeps old files only)
    os.utime(big, (old, old))
    copy_to = workdir / "release-copy.bin"
    start = time.perf_counter()
    shutil.copyfile(big, copy_to)
    os.sync()
    copied = time.perf_counter() - start
    copy_to.unlink()
    print(f"# release: {args.release_mb} MB random file; cp of its bytes {copied:.3f} s  {load()}", flush=True)
    for label, code in codes.items():
        root = workdir / f"release-{label}"
        shutil.copytree(big.parent, root, copy_function=os.link)  # the same inode: the same file, no new bytes
        (root / "small.py").write_text("x = 1\n")
        os.utime(root / "small.py", (old, old))
        (root / "inventory.yaml").write_text(RELEASE_INVENTORY.format(python=PYTHON))
        env_cache = {"DFLASHOPS_MANIFEST_CACHE": str(root / "manifest-cache.json")}
        steps = [("big", "first deploy", None), ("big", "unchanged deploy", None), ("big", "small-change deploy", "x = 2\n"),
                 ("small", "first deploy (no big file)", None), ("small", "unchanged deploy (no big file)", None),
                 ("small", "small-change deploy (no big file)", "x = 3\n")]  # fmt: skip
        for index, (profile, what, change) in enumerate(steps):
            if change is not None:
                (root / "small.py").write_text(change)
                os.utime(root / "small.py", (old + index, old + index))
            argv = ["/usr/bin/time", "-f", "maxrss_kb=%M", PYTHON, "-m", "dflashops.cli.main", "--inventory",
                    str(root / "inventory.yaml"), "deploy", "local", "--profile", profile, "--name", f"{label}{index}",
                    "--detach"]  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(code), **env_cache}, cwd=code,
                                  capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
            seconds = time.perf_counter() - start
            rss = next((ln for ln in done.stderr.splitlines() if ln.startswith("maxrss_kb=")), "")
            note = rss if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
            report(f"{what}", label, seconds, len(done.stdout), note)
        stop = [PYTHON, "-m", "dflashops.cli.main", "--inventory", str(root / "inventory.yaml"), "stop", "--all",
                "--now"]  # fmt: skip
        subprocess.run(stop, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=TIMEOUT_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measure", choices=("status", "lineage", "sync", "release", "all"))
    parser.add_argument("--release-mb", type=int, default=200)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=300)
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", default="main", help="the git ref measured as 'before' (default: main)")
    parser.add_argument("--after-only", action="store_true", help="measure this checkout only (a re-run)")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dflashops-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    codes = {"before": main_code(workdir, args.before), "after": REPO}
    if args.after_only:
        del codes["before"]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {os.cpu_count()} cores, {load()}, before={args.before}", flush=True)
    try:
        measures = (
            ("status", bench_status),
            ("lineage", bench_lineage),
            ("sync", bench_sync),
            ("release", bench_release),
        )
        for measure, run in measures:
            if args.measure in (measure, "all"):
                run(args, workdir, codes)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
