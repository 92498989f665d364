"""Where the test suite's CPU time goes: per test file and per kind of process (issue 29 item 11).

    .venv/bin/python bench/suite_cpu.py run OUT_DIR [PYTEST ARGS...]   # e.g. -n 2 --dist loadfile tests/trainer
    .venv/bin/python bench/suite_cpu.py report OUT_DIR [--top N]

On a machine shared with other work wall time says little, so this counts CPU-seconds (user + system):

- every Python interpreter of the venv that runs while the suite runs (pytest workers, CLIs, agents, trainers,
  standbys, workloads) records its own CPU time, argv and the test it ran under (PYTEST_CURRENT_TEST, else the
  test the nearest recorded ancestor ran under) when it exits normally. The hook is a `.pth` file that `run`
  puts in the venv's site-packages for the run and removes after; it acts only while OUT_DIR/active exists, so
  an environment scrubbed by the code under test (a standby, an sshd session) is still counted. A process that
  ends by a signal it does not handle (SIGKILL) is not counted: its CPU is missing, not misplaced.
- the pytest plugin in this file records, per test, the worker's own CPU and that of the children it waited for
  (RUSAGE_CHILDREN: g++, tmux clients, shells, and the Python children again) and per file the worker CPU
  spent outside any test (collection, module and session fixtures' set-up and tear-down are inside tests).

`report` prints the total, the top files by CPU of every process that ran for them, and the top process kinds.
Python processes outside the venv (the system python3) and detached non-Python processes (a tmux server) are
not counted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

PTH_NAME = "zz_suite_cpu_hook.pth"
HOOK_MODULE = "_suite_cpu_hook"
# A .pth line starting with `import` runs at every interpreter start: one stat of the marker file when inactive.
PTH = "import os; os.path.exists({active!r}) and __import__({module!r}).install({out!r})\n"
# The hook itself, written beside the .pth for the run (the code under test may scrub PYTHONPATH and cwd).
HOOK = """
import atexit, json, os, resource, sys

def _chain():
    pids, pid = [], os.getppid()
    for _ in range(12):
        if pid <= 1:
            break
        pids.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids

def install(out):
    global _installed
    if globals().get("_installed"):  # the venv's lib64 -> lib symlink makes site read the .pth twice
        return
    _installed = True
    info = {"pid": os.getpid(), "ancestors": _chain(), "test": os.environ.get("PYTEST_CURRENT_TEST"),
            "argv": list(getattr(sys, "orig_argv", sys.argv))[1:]}

    def record():
        u = resource.getrusage(resource.RUSAGE_SELF)
        row = dict(info, pid=os.getpid(), cpu=u.ru_utime + u.ru_stime, torch="torch" in sys.modules,
                   pytest="_pytest" in sys.modules and "xdist" in sys.modules)
        if row["pid"] != info["pid"]:  # a fork: its own ancestors, its own counters
            row["ancestors"] = [info["pid"]] + info["ancestors"]
        try:
            with open(os.path.join(out, "procs", f"{row['pid']}-{os.urandom(3).hex()}.json"), "w") as f:
                json.dump(row, f)
        except OSError:
            pass

    atexit.register(record)
"""


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


# --- the pytest plugin (loaded with -p bench.suite_cpu) ---


class _PerTest:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.start: tuple[float, float] | None = None
        self.wall = 0.0

    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> None:
        self.start = (
            _cpu(resource.getrusage(resource.RUSAGE_SELF)),
            _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)),
        )
        self.wall = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if self.start is None:  # xdist's controller: the report of a test a worker ran
            return
        own = _cpu(resource.getrusage(resource.RUSAGE_SELF)) - self.start[0]
        kids = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - self.start[1]
        row = {"test": nodeid, "self": own, "children": kids, "wall": time.monotonic() - self.wall, "pid": os.getpid()}
        self.start = None
        with open(self.out / "tests.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_configure(config: Any) -> None:
    out = os.environ.get("SUITE_CPU_DIR")
    if out:
        config.pluginmanager.register(_PerTest(Path(out)), "suite_cpu_per_test")


# --- run and report ---


def run(out: Path, pytest_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o1777)  # the remote tests' unprivileged user writes its processes' rows too
    (out / "procs").mkdir(exist_ok=True)
    (out / "procs").chmod(0o1777)
    site = Path(sysconfig.get_paths()["purelib"])
    pth, module = site / PTH_NAME, site / f"{HOOK_MODULE}.py"
    module.write_text(HOOK)
    pth.write_text(PTH.format(active=str(out / "active"), module=HOOK_MODULE, out=str(out)))
    (out / "active").touch()
    env = dict(os.environ, SUITE_CPU_DIR=str(out))
    root = Path(__file__).resolve().parent.parent
    started = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "bench.suite_cpu", *pytest_args], cwd=root, env=env)
    finally:
        (out / "active").unlink(missing_ok=True)
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = {
        "rc": rc,
        "wall": time.monotonic() - started,
        "waited_cpu": _cpu(after) - _cpu(before),
        "loadavg": os.getloadavg(),
        "args": pytest_args,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    report(out, 25)
    return rc


def _kind(argv: list[str]) -> str:
    """A short name for what a process was: `pytest`, `trainer train`, `dflashops restart`, `agent launch`..."""
    if not argv:
        return "?"
    a = [x for x in argv if x]
    if a[0] == "-m" and len(a) > 1:
        return " ".join(a[1:3]) if a[1] in ("trainer", "dflashops") else a[1]
    if a[0] == "-c":
        return "python -c"
    name = Path(a[0]).name
    if name in ("pytest", "py.test") or "xdist" in " ".join(a):
        return "pytest"
    if name in ("dflashops", "__main__.py") or name.endswith(".pyz"):
        return f"{name} {a[1] if len(a) > 1 else ''}".strip()
    if name == "agent.py":
        return f"agent {a[1] if len(a) > 1 else ''}".strip()
    return name


def report(out: Path, top: int) -> None:
    procs: list[dict[str, Any]] = []
    for f in (out / "procs").glob("*.json"):
        try:
            procs.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    by_pid = {p["pid"]: p for p in procs}
    rows = out / "tests.jsonl"
    tests = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []

    names = {t["test"].split("::")[1].split("[")[0][:30]: t["test"] for t in tests}

    def test_of(p: dict[str, Any]) -> str:
        """The test a process ran under: its own or its nearest recorded ancestor's PYTEST_CURRENT_TEST, else
        the test whose tmp_path its argv names (pytest cuts that folder's name to 30 characters)."""
        first, seen = p, 0
        while p and seen < 50:
            if p.get("test"):
                return str(p["test"]).split(" ")[0]
            p = next((by_pid[a] for a in p.get("ancestors", []) if a in by_pid), {})
            seen += 1
        found = re.search(r"/popen-gw\d+/(test_\w+?)\d*/|/pytest-\d+/(test_\w+?)\d*/", " ".join(first["argv"]))
        name = found and (found.group(1) or found.group(2))
        return names.get(name, "?") if name else "?"

    files: dict[str, float] = defaultdict(float)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    torch_cpu = [0, 0.0]
    total = 0.0
    for p in procs:
        cpu = p["cpu"]
        total += cpu
        kind = "pytest" if p.get("pytest") else _kind(p["argv"])
        kinds[kind][0] += 1
        kinds[kind][1] += cpu
        if p.get("torch"):
            torch_cpu[0] += 1
            torch_cpu[1] += cpu
        if not p.get("pytest"):
            files[test_of(p).split("::")[0]] += cpu
    waited: dict[str, float] = defaultdict(float)
    worker: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for t in tests:
        f = t["test"].split("::")[0]
        worker[f] += t["self"]
        waited[f] += t["children"]
        wall[f] += t["wall"]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    print(
        f"python processes: {len(procs)}, {total:.0f} CPU-s (pytest workers included); torch imported in "
        f"{torch_cpu[0]} of them, {torch_cpu[1]:.0f} CPU-s"
    )
    if summary:
        print(
            f"pytest rc {summary['rc']}, wall {summary['wall']:.0f} s, waited-for children's CPU "
            f"{summary['waited_cpu']:.0f} s, load average at the end {summary['loadavg']}"
        )
    print(f"tests' wall time (sum over workers): {sum(wall.values()):.0f} s")
    print("\ntop files by CPU: sum = kids (python processes of its tests, any depth) + worker (the pytest worker in")
    print(
        "its tests); waited = CPU of the children the worker waited for (non-python too); wall = its tests' wall time"
    )
    allf = set(files) | set(worker)
    order = sorted(allf, key=lambda f: files.get(f, 0) + worker.get(f, 0), reverse=True)
    print(f"{'file':60} {'sum':>7} {'kids':>7} {'worker':>7} {'waited':>7} {'wall':>7}")
    for f in order[:top]:
        k, w = files.get(f, 0.0), worker.get(f, 0.0)
        print(f"{f:60} {k + w:7.1f} {k:7.1f} {w:7.1f} {waited.get(f, 0.0):7.1f} {wall.get(f, 0.0):7.1f}")
    print("\ntop process kinds: count, CPU-s, CPU-s each")
    for kind, (n, cpu) in sorted(kinds.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
        print(f"{kind:48} {n:5} {cpu:8.1f} {cpu / n:6.2f}")
    slow = sorted(tests, key=lambda t: t["self"] + t["children"], reverse=True)[:top]
    print("\ntop tests by worker + waited children's CPU; wall")
    for t in slow:
        print(f"{t['test'][:100]:100} {t['self'] + t['children']:7.1f} {t['wall']:7.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("pytest_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("report")
    p.add_argument("out", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if args.verb == "run":
        return run(args.out.resolve(), args.pytest_args)
    report(args.out, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
