"""dflashops doctor probe: a stdlib-only program run inside the target, sent on stdin (`python3 - --json-args
JSON`), so it writes nothing there: a full disk, an unwritable workspace or a missing agent do not stop it.

It reports facts, never verdicts (ops/doctor/doctor_checks.py judges them), as ONE JSON line on stdout, like the agent:
the python that runs it, the /dev/nvidia* nodes, nvidia-smi's answer, the kernel module's version, what the
run's python imports (torch and whether it sees CUDA and how many devices, transformers, triton; run in a
child with the run's environment and a timeout, since a broken CUDA install can hang an import), the
launchers' tools, free space on the workspace and inductor-cache filesystems, whether the workspace takes a
new file, and this machine's clock.

Request: {"workspace": abs path, "python": the run's python, "env": the target's env (no secrets),
"gpus": [declared ids], "import_timeout": seconds, "imports": false when the run's python is known not to run
(the probe then does not start it), "code_hash": the code the controller would deploy now, "compile_cache": the
compile caches' root}.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

STARTED = time.time()
IMPORT_PROBE = r"""
import json, sys
out = {"version": sys.version.split()[0], "executable": sys.executable}
found = {}
for name in ("torch", "transformers", "triton"):  # the target's own packages, imported in the target's python
    try:
        found[name] = __import__(name)
        out[name] = getattr(found[name], "__version__", "unknown")
    except Exception as exc:
        out[name + "_error"] = f"{type(exc).__name__}: {exc}"
cuda = found["torch"].cuda if "torch" in found else None
try:
    if cuda is not None:
        out["cuda_build"] = found["torch"].version.cuda
        out["cuda_available"] = bool(cuda.is_available())
        out["device_count"] = cuda.device_count() if out["cuda_available"] else 0
        out["devices"] = [cuda.get_device_name(i) for i in range(out["device_count"])]
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def nearest_existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def disk(path: str) -> dict:
    where = nearest_existing(path)
    try:
        stat = os.statvfs(where)
        device = os.stat(where).st_dev
    except OSError as exc:
        return {"path": path, "measured_at": where, "error": str(exc)}
    return {
        "path": path,
        "measured_at": where,
        "free_bytes": stat.f_bavail * stat.f_frsize,
        "total_bytes": stat.f_blocks * stat.f_frsize,
        "device": device,
    }


def writable(workspace: str) -> dict:
    """Create and remove one empty file (needs a free inode and permission, no data blocks: a full disk's
    own check reports the space)."""
    where = nearest_existing(workspace)
    probe = os.path.join(where, f".dflashops-doctor-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return {"ok": False, "at": where, "error": f"{exc.strerror} ({where})", "exists": where == workspace}
    return {"ok": True, "at": where, "exists": where == workspace}


def nvidia_smi() -> dict:
    path = shutil.which("nvidia-smi")
    if path is None:
        return {"path": None}
    try:
        done = subprocess.run(
            [path, "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"path": path, "exit_code": None, "error": str(exc)}
    gpus = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append({"index": parts[0], "name": parts[1], "driver": parts[2], "memory_mib": parts[3]})
    output = (done.stdout + done.stderr).strip().splitlines()
    return {"path": path, "exit_code": done.returncode, "gpus": gpus, "output": output[-4:]}


def kernel_module() -> str | None:
    """The loaded NVIDIA kernel module's version: the host's, since a container shares the host's kernel."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as handle:
            first = handle.readline()
    except OSError:
        return None
    words = [w for w in first.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else first.strip() or None


def imports(req: dict) -> dict:
    env = {**os.environ, **{str(k): str(v) for k, v in (req.get("env") or {}).items()}}
    if req.get("gpus"):
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in req["gpus"]))  # as deploy sets it
    timeout = float(req.get("import_timeout", 180))
    try:
        done = subprocess.run(
            [req.get("python") or sys.executable, "-c", IMPORT_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return {"missing": True}
    except PermissionError as exc:
        return {"missing": True, "error": str(exc)}
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch/transformers/triton took over {timeout:g}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": tail}
    return json.loads(lines[-1])


def standbys(workspace: str) -> list[dict]:
    """The standby interpreters waiting in the workspace (standby.py): id, whether its imports
    are done (`ready`: the interpreter's pid, and for how long), claimed or retired. Reads files only."""
    found = []
    for folder in sorted(glob.glob(os.path.join(workspace, "standby", "*", "spec.json"))):
        folder = os.path.dirname(folder)
        ready = os.path.join(folder, "ready")
        pid, waiting_s = None, None
        try:
            with open(ready) as handle:
                pid = int(handle.read().strip())
            waiting_s = time.time() - os.path.getmtime(ready)
        except (OSError, ValueError):  # not ready yet (or it just left)
            pass
        found.append(
            {
                "id": os.path.basename(folder),
                "pid": pid,
                "alive": bool(pid) and os.path.exists(f"/proc/{pid}"),
                "waiting_s": waiting_s,
                "claimed": os.path.exists(os.path.join(folder, "claimed")),
                "retired": os.path.exists(os.path.join(folder, "retired")),
            }
        )
    return found


def compile_cache(workspace: str, root: str, code_hash: str) -> dict:
    """The workspace's compile caches (trainer/core/compile_cache.py: one folder per machine kind, shared by every code
    version) with their sizes, and what the newest run of `code_hash` said of them (its status.json
    `compile_cache`: graphs reused and compiled). Reads files only."""
    caches = []
    for key in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, key)
        if os.path.isdir(path):
            size = files = 0
            for folder, _, names in os.walk(path):
                for name in names:
                    try:
                        size += os.lstat(os.path.join(folder, name)).st_size
                        files += 1
                    except OSError:
                        pass
            caches.append({"key": key, "bytes": size, "files": files})
    newest = None
    for run_json in glob.glob(os.path.join(workspace, "runs", "*", "run.json")):
        try:
            with open(run_json) as handle:
                if json.load(handle).get("code_hash") != code_hash:
                    continue
            with open(os.path.join(os.path.dirname(run_json), "status.json")) as handle:
                seen = json.load(handle).get("compile_cache")
            when = os.path.getmtime(run_json)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(seen, dict) and (newest is None or when > newest["when"]):
            newest = {"run": os.path.basename(os.path.dirname(run_json)), "when": when, **seen}
    return {"caches": caches, "code_hash": code_hash, "newest_run": newest}


def main(argv: list[str]) -> int:
    try:
        req = json.loads(argv[argv.index("--json-args") + 1]) if "--json-args" in argv else {}
        workspace = str(req["workspace"])
        cache_root = str(req.get("compile_cache") or os.path.join(workspace, "cache", "compile"))
        answer = {
            "ok": True,
            "probe_python": sys.executable,
            "probe_version": sys.version.split()[0],
            "devices": sorted(glob.glob("/dev/nvidia*")),
            "nvidia_smi": nvidia_smi(),
            "kernel_module": kernel_module(),
            "imports": imports(req) if req.get("imports", True) else {"skipped": True},
            "tools": {name: shutil.which(name) for name in ("tmux", "nohup", "setsid")},
            "disk": {"workspace": disk(workspace), "cache": disk(cache_root)},
            "writable": writable(workspace),
            "standbys": standbys(workspace),
            "compile_cache": compile_cache(workspace, cache_root, str(req.get("code_hash") or "")),
            "time_started": STARTED,
            "time": time.time(),
        }
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        answer = {"ok": False, "error": f"bad doctor request: {exc}", "code": "bad_request"}
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
