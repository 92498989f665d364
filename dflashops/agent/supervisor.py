"""dflashops supervisor: a stdlib-only daemon in the target, beside one run, that outlives the controller.

Started by the controller after a launch whose profile sets `on_failure` and/or `stall`:
`python3 agent-<sha12>.pyz supervise start --json-stdin` reads the request (with the run's secrets and an optional
webhook URL: both held in memory only, never written), forks a daemon detached by setsid (not in the run's
process group and without the run's marker, so `stop` never hits it), prints ONE JSON line
`{"ok": true, "pid": N}` and exits. The daemon runs from that zipapp and uses the agent's own modules (plain imports) for everything a
run needs: `run_status`, `verb_launch`, the run's own processes.

Loop, for the run it watches:
- every `poll_s`: still running? A stall (`stall.heartbeat_s` without a fresh status.json heartbeat, or
  without a new step while status.json says "training"; or every GPU of the run below `gpu_util_below`
  percent for `for_s` while training) writes `stall.json` and SIGTERMs the run's own process group
  (SIGKILL after `grace_s`): a stall counts as a failure.
- when it ended: finished -> done; stopped by `dflashops stop` (stop.json) -> done, no restart; crashed,
  lost or stalled -> with `on_failure` and restarts left (and the exit code listed, when `exit_codes` is
  set; a stall always counts), wait `backoff_s`, then launch a NEW run `<root>-rK` whose parent is the
  failed run, from its latest checkpoint (`resume`), with the note "auto-restart after exit C at step N:
  <error line>", and watch that one.
Each event (crashed, stalled, auto-restarted, gave-up, finished) is appended to the run's `events.jsonl`
(and POSTed to the webhook when one was given); `supervisor.json` in the watched run's directory says
what the supervisor does now (the agent's `stop` reads it to cancel a pending restart).

Part of the agent's package, so it travels inside the agent's one zipapp and runs with whatever python3 the
container has; `stop` and `status` know a live supervisor by the `supervise` word of its command line.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from .answers import RunEntry, answer_json
from .checkpoints import latest_checkpoint
from .common import AgentFailure, read_int, read_json, read_text, run_processes, signal_run, write_atomic
from .launch import verb_launch
from .protocol import LaunchRequest
from .run_lock import release_control, try_control
from .status import run_status
from .template_sentinels import SENTINELS

CANCELLED: list[bool] = []  # set by SIGTERM: the daemon ends at its next check, restarting nothing
WEBHOOK_RETRY_S = (5.0, 30.0)  # the waits before a failed POST's second and third try (notify.retry)


def fill(value, values: dict):
    """`value` with every sentinel replaced (strings in lists and dicts, deep)."""
    if isinstance(value, str):
        for key, sentinel in SENTINELS.items():
            value = value.replace(sentinel, values.get(key, ""))
        return value
    if isinstance(value, list):
        return [fill(item, values) for item in value]
    if isinstance(value, dict):
        return {key: fill(item, values) for key, item in value.items()}
    return value


class Supervisor:
    def __init__(self, req: dict) -> None:
        self.req = req
        self.workspace = req["workspace"]
        self.root = req["root"]
        self.restarts = int(req.get("restarts", 0))
        self.policy = req.get("on_failure") or None
        self.stall: dict = req.get("stall") or {}
        self.poll_s = float(req.get("poll_s", 2.0))
        self.courier: queue.Queue = queue.Queue()
        self.courier_thread = threading.Thread(target=self.deliver, name="webhook-courier", daemon=True)
        self.courier_thread.start()

    # -- bookkeeping ----------------------------------------------------------------------------------
    def run_dir(self, name: str) -> str:
        return os.path.join(self.workspace, "runs", name)

    def log(self, text: str) -> None:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {text}", flush=True)

    def state(self, run: str, state: str, **fields) -> None:
        info = {
            "pid": os.getpid(),
            "root": self.root,
            "run": run,
            "state": state,
            "restarts": self.restarts,
            "max_restarts": (self.policy or {}).get("max_restarts", 0),
            "updated_at": time.time(),
            **fields,
        }
        try:
            write_atomic(os.path.join(self.run_dir(run), "supervisor.json"), json.dumps(info) + "\n")
        except OSError:
            pass  # a full disk must not end the supervision

    def event(self, run: str, kind: str, message: str, **fields) -> None:
        """Append the event to the run's events.jsonl at once; a webhook POST (when asked for) is only queued
        here and made by the courier thread, so a slow or dead webhook never delays a restart. The courier
        appends the delivery's outcome as a line of its own (`delivery`, `webhook`)."""
        entry = {
            "id": f"{run}:{kind}",
            "event": kind,
            "run": run,
            "target": self.req.get("target"),
            "time": time.time(),
            "message": message,
            "source": "supervisor",
            **fields,
        }
        wanted = kind in (self.req.get("events") or [kind]) and bool(self.req.get("webhook"))
        entry["webhook"] = "queued" if wanted else "off"
        self.log(f"{kind}: {message} (webhook {entry['webhook']})")
        self.append_event(run, entry)
        if wanted:
            self.courier.put((run, entry))

    def append_event(self, run: str, entry: dict) -> None:
        try:
            with open(os.path.join(self.run_dir(run), "events.jsonl"), "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
        except OSError:
            pass

    def deliver(self) -> None:
        """The courier thread: POST each queued event (each try bounded by webhook_timeout_s; a failure tried
        again after each of the `webhook_retry_s` waits), then record the outcome in the run's events.jsonl."""
        while True:
            item = self.courier.get()
            if item is None:
                return
            run, entry = item
            outcome, waits = "off", [float(w) for w in self.req.get("webhook_retry_s", WEBHOOK_RETRY_S)]
            for attempt in range(len(waits) + 1):
                if attempt:
                    time.sleep(waits[attempt - 1])
                outcome = self.post(entry)
                if outcome == "sent":
                    break
            self.log(f"webhook for {entry['id']}: {outcome} ({attempt + 1} attempt(s))")
            self.append_event(run, {"delivery": entry["id"], "webhook": outcome, "attempts": attempt + 1,
                                    "time": time.time()})  # fmt: skip
            self.courier.task_done()

    def post(self, entry: dict) -> str:
        url = self.req.get("webhook")
        if not url:
            return "off"
        payload = {k: v for k, v in entry.items() if k != "webhook"}
        body = json.dumps({**payload, "text": f"dflashops: {entry['message']}"}).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "dflashops-supervisor"}
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None:  # userinfo -> Basic auth, as transport/webhook.py does
            token = base64.b64encode(
                f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}".encode()
            ).decode()
            headers["Authorization"] = f"Basic {token}"
            host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
            url = urllib.parse.urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))
        request = urllib.request.Request(url, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=float(self.req.get("webhook_timeout_s", 10))) as answer:
                return "sent" if 200 <= answer.status < 300 else f"failed: HTTP {answer.status}"
        except urllib.error.HTTPError as exc:
            return f"failed: HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # the URL stays out of the message: it may carry a token
            return f"failed: {type(exc).__name__}"

    def drain(self) -> None:
        """Before the daemon exits: let the courier finish what is queued (each POST is bounded)."""
        self.courier.put(None)
        self.courier_thread.join()

    # -- watching -------------------------------------------------------------------------------------
    def gpu_utilisation(self) -> list[int] | None:
        if not shutil.which("nvidia-smi"):
            return None
        try:
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        wanted = {str(g) for g in self.req.get("gpus") or []}
        values = []
        for line in done.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[1].isdigit() and (not wanted or parts[0] in wanted):
                values.append(int(parts[1]))
        return values or None

    def stop_stalled(self, directory: str, reason: str, clock: dict) -> None:
        """stall.json first (so the end reads as a stall, not a stop), then TERM the run's own group, KILL
        after the grace; holding the run's control lock (agent.take_control), so that it never meets a stop or
        restart of the same run: while one of those acts, the stall waits for the next look."""
        lock = try_control(directory, "stall stop")
        if lock is None:
            return
        try:
            self.signal_stalled(directory, reason, clock)
        finally:
            release_control(directory, lock, {"stalled": reason})

    def signal_stalled(self, directory: str, reason: str, clock: dict) -> None:
        write_atomic(
            os.path.join(directory, "stall.json"),
            json.dumps(
                {
                    "reason": reason,
                    "at": time.time(),
                    "last_heartbeat": clock.get("beat"),
                    "last_step": clock.get("step"),
                    "last_step_at": clock.get("step_at"),
                }
            ),
        )
        marker = (read_text(os.path.join(directory, "marker")) or "").strip() or None
        pgid, pids = run_processes(read_int(os.path.join(directory, "pgid")), marker, directory)
        self.log(f"stalled: {reason}; SIGTERM to process group {pgid} ({sorted(pids)})")
        signal_run(pgid, pids, signal.SIGTERM)
        deadline = time.monotonic() + float(self.stall.get("grace_s", 60.0))
        while time.monotonic() < deadline and run_processes(pgid, marker, directory)[1]:
            time.sleep(0.1)
        left = run_processes(pgid, marker, directory)[1]
        if left:
            signal_run(pgid, left, signal.SIGKILL)

    def stalled(self, status: RunEntry, clock: dict) -> str | None:
        """Why the running run counts as stalled now, or None. `clock` keeps the last step and when it moved,
        and since when the GPUs are idle."""
        if not self.stall or status.state != "running":
            return None
        now, trainer = time.time(), status.trainer_status or {}
        phase = trainer.get("phase")
        if status.step != clock.get("step"):
            clock["step"], clock["step_at"] = status.step, now
        limit = self.stall.get("heartbeat_s")
        if limit:
            heartbeat = trainer.get("heartbeat")
            beat = heartbeat if isinstance(heartbeat, (int, float)) else clock["started"]
            clock["beat"] = beat
            if now - max(float(beat), clock["started"]) > limit:
                return (
                    f"no status.json heartbeat for {now - max(float(beat), clock['started']):.0f}s (limit {limit:g}s)"
                )
            if phase == "training" and now - clock["step_at"] > limit:
                return f"no new step for {now - clock['step_at']:.0f}s while training, at step {status.step} (limit {limit:g}s)"
        below = self.stall.get("gpu_util_below")
        if below is not None and phase == "training":
            used = self.gpu_utilisation()
            if used is not None and max(used) < below:
                clock.setdefault("idle_since", now)
                if now - clock["idle_since"] >= float(self.stall.get("for_s", 600)):
                    return f"GPUs {used}% busy (below {below:g}%) for {now - clock['idle_since']:.0f}s while training"
            else:
                clock.pop("idle_since", None)
        return None

    def watch(self, run: str) -> dict:
        """Until `run` ends: {"kind": finished|stopped|crashed|stalled|cancelled, ...the run's last status}."""
        directory = self.run_dir(run)
        pid_file = os.path.join(directory, "pid")
        clock: dict = {
            "started": os.stat(pid_file).st_mtime if os.path.exists(pid_file) else time.time(),
            "step_at": time.time(),
        }
        clock["step"] = None
        while not CANCELLED:
            status = run_status(directory)
            if status.state in ("running", "stopping", "launching"):
                reason = self.stalled(status, clock)
                if reason and not os.path.exists(os.path.join(directory, "stop.json")):
                    self.stop_stalled(directory, reason, clock)
                    continue
                time.sleep(self.poll_s)
                continue
            time.sleep(0.5)  # a stop writes stop.json right after its signal: let it land before judging
            status = run_status(directory)
            stall = read_json(os.path.join(directory, "stall.json"))
            ended = answer_json(status)  # the outcome is the run's status entry, with its kind
            if stall:
                return {**ended, "kind": "stalled", "reason": stall.get("reason")}
            if status.state in ("finished", "stopped"):
                return {**ended, "kind": status.state}
            return {**ended, "kind": "crashed"}
        return {"kind": "cancelled"}

    # -- restarting -----------------------------------------------------------------------------------
    def latest_checkpoint(self, chain: list[str]) -> str | None:
        """The newest checkpoint of the failed run, else of its supervised ancestors (a run that crashed before
        its first save resumes from the one before it); one its dead writer left unfinished is committed first."""
        for run in reversed(chain):
            found = latest_checkpoint(self.run_dir(run))
            if found:
                return found
        return None

    def child_name(self) -> str:
        stem = self.root[: 64 - len(f"-r{self.restarts}")]
        name, extra = f"{stem}-r{self.restarts}", 0
        while os.path.exists(self.run_dir(name)):  # a name taken by hand: the next free one
            extra += 1
            name = f"{stem[: 64 - len(f'-r{self.restarts}-{extra}')]}-r{self.restarts}-{extra}"
        return name

    def launch_child(self, failed: dict, chain: list[str], note: str) -> tuple[str, str | None]:
        template = self.req["template"]
        checkpoint = self.latest_checkpoint(chain) if (self.policy or {}).get("resume", True) else None
        values = {"name": self.child_name(), "parent": failed["name"], "note": note, "checkpoint": checkpoint or ""}
        argv = fill(template["argv_resume"] if checkpoint and template.get("argv_resume") else template["argv"], values)
        run_json = fill(template["run_json"], values)
        run_json.update(
            name=values["name"],
            parent=failed["name"],
            note=note,
            hypothesis=note,
            argv=fill(
                template["shown_argv_resume"]
                if checkpoint and template.get("shown_argv_resume")
                else template["shown_argv"],
                values,
            ),
            started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            state="launched",
            exit_code=None,
            last_step=None,
            session=values["name"],
        )
        run_json["extra"] = {
            **(run_json.get("extra") or {}),
            "resumed_from": checkpoint,
            "auto_restart": {
                "attempt": self.restarts,
                "of": failed["name"],
                "exit_code": failed.get("exit_code"),
                "step": failed.get("step"),
                "line": failed.get("line"),
                "kind": failed["kind"],
            },
        }
        verb_launch(
            LaunchRequest(
                workspace=self.workspace,
                name=values["name"],
                argv=argv,
                env=fill(template["env"], values),
                cwd=fill(template["cwd"], values),
                launcher=template.get("launcher", "nohup"),
                standby=template.get("standby", False),
                standby_idle_s=template.get("standby_idle_s"),
                run_json=run_json,
            )
        )
        return values["name"], checkpoint

    def handle_failure(self, run: str, outcome: dict, chain: list[str]) -> str | None:
        """Record the failure; the child run's name when it was restarted, None when this is the end."""
        line = outcome.get("reason") if outcome["kind"] == "stalled" else outcome.get("error_line")
        code, step = outcome.get("exit_code"), outcome.get("step")
        what = "stalled" if outcome["kind"] == "stalled" else f"exit {code if code is not None else '?'}"
        where = f" at step {step}" if step is not None else ""
        self.event(
            run,
            outcome["kind"],
            f"{run} {what}{where}" + (f": {line}" if line else ""),
            exit_code=code,
            step=step,
            log_line=line,
        )
        policy = self.policy
        if not policy:
            self.state(run, "done", reason="no on_failure policy")
            return None
        refused = None
        if self.restarts >= int(policy.get("max_restarts", 3)):
            refused = f"max_restarts {policy.get('max_restarts')} reached"
        elif outcome["kind"] != "stalled" and policy.get("exit_codes") and code not in policy["exit_codes"]:
            refused = f"exit code {code} is not in on_failure.exit_codes {policy['exit_codes']}"
        if refused:
            self.event(run, "gave-up", f"not restarting {run}: {refused}", exit_code=code, step=step)
            self.state(run, "gave-up", reason=refused)
            return None
        backoff = float(policy.get("backoff_s", 60.0))
        self.state(run, "backoff", until=time.time() + backoff)
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline and not CANCELLED:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        lock = self.control(run)  # a user's stop or restart of `run` acts first, and cancels this supervisor
        if lock is None:
            return None
        self.restarts += 1
        note = f"auto-restart after {what}{where}" + (f": {line}" if line else "")
        try:
            child, checkpoint = self.launch_child({**outcome, "name": run, "line": line}, chain, note)
        except (AgentFailure, OSError) as exc:
            release_control(self.run_dir(run), lock, {"error": str(exc)})
            self.event(run, "gave-up", f"could not launch the restart of {run}: {exc}")
            self.state(run, "gave-up", reason=str(exc))
            return None
        release_control(self.run_dir(run), lock, {"name": child, "checkpoint": checkpoint})
        write_atomic(os.path.join(self.run_dir(run), "restarted_as"), child + "\n")
        self.state(run, "restarted", child=child)
        self.event(
            child,
            "auto-restarted",
            f"{child} restarted {run} ({note})"
            + (f" from {os.path.basename(checkpoint)}" if checkpoint else " from scratch"),
            parent=run,
            attempt=self.restarts,
            checkpoint=checkpoint,
            exit_code=code,
            step=step,
            log_line=line,
        )
        return child

    def control(self, run: str) -> int | None:
        """The control lock of `run` (agent.take_control), waited for while a stop or restart holds it; None
        once this supervisor is cancelled (those cancel it before they act)."""
        while not CANCELLED:
            lock = try_control(self.run_dir(run), "auto-restart")
            if lock is not None:
                if not CANCELLED:
                    return lock
                release_control(self.run_dir(run), lock, {"cancelled": True})
                break
            time.sleep(0.2)
        return None

    def run(self) -> None:
        current, chain = self.req["run"], [self.req["run"]]
        while not CANCELLED:
            self.state(current, "watching")
            outcome = self.watch(current)
            if outcome["kind"] == "cancelled":
                break
            if outcome["kind"] == "finished":
                self.event(
                    current, "finished", f"{current} finished at step {outcome.get('step')}", step=outcome.get("step")
                )
                self.state(current, "done", reason="finished")
                return
            if outcome["kind"] == "stopped":
                self.state(current, "done", reason="stopped")
                return
            child = self.handle_failure(current, outcome, chain)
            if child is None:
                break
            current = child
            chain.append(child)
        if CANCELLED:
            self.state(current, "cancelled", reason="dflashops stop")


def daemonize(req: dict) -> int:
    """Fork, setsid (out of the run's group), fork again; point stdio at the supervisor log; the parent prints
    the daemon's pid once it is ready."""
    logs = os.path.join(req["workspace"], "supervisors")
    os.makedirs(logs, exist_ok=True)
    read_end, write_end = os.pipe()
    if os.fork():
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            pid = pipe.read().strip()
        os.wait()
        if pid.isdigit():
            answer = {"ok": True, "pid": int(pid), "log": os.path.join(logs, f"{req['root']}.log")}
        elif pid.startswith("busy "):
            holder = pid.split()[1]
            answer = {"ok": False, "error": f"{req['root']} is supervised already (pid {holder})", "code": "conflict"}
        else:
            answer = {"ok": False, "error": "supervisor did not start", "code": "error"}
        print(json.dumps(answer), flush=True)
        return 0
    os.close(read_end)
    os.setsid()
    if os.fork():
        os._exit(0)
    # One supervisor per lineage root: two commands that both found it dead and started a new one (ops/supervise
    # revive) must not get two, each restarting every crash. The kernel drops the lock when the daemon dies.
    guard = os.open(os.path.join(logs, f"{req['root']}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.write(write_end, f"busy {os.pread(guard, 32, 0).decode(errors='replace').strip() or '?'}".encode())
        os._exit(0)
    os.ftruncate(guard, 0)
    os.pwrite(guard, str(os.getpid()).encode(), 0)
    log = os.open(os.path.join(logs, f"{req['root']}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for low, high in ((3, min(write_end, guard)), (min(write_end, guard) + 1, max(write_end, guard))):
        os.closerange(low, high)
    os.closerange(max(write_end, guard) + 1, 1 << 16)
    signal.signal(signal.SIGTERM, lambda *_: CANCELLED.append(True))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the controller's ssh channel going away is not a reason
    supervisor = Supervisor(req)
    os.write(write_end, str(os.getpid()).encode())
    os.close(write_end)
    try:
        supervisor.log(f"supervising {req['run']} (restarts so far {supervisor.restarts})")
        supervisor.run()
        supervisor.drain()
    except BaseException as exc:  # noqa: BLE001 - the log is the only place left to say it
        supervisor.log(f"supervisor failed: {type(exc).__name__}: {exc}")
    os._exit(0)


def main(argv: list[str]) -> int:
    if argv[:1] != ["start"]:
        print(json.dumps({"ok": False, "error": "usage: supervisor start --json-stdin", "code": "bad_request"}))
        return 2
    try:
        req = json.loads(sys.stdin.read())
        for key in ("workspace", "root", "run", "template"):
            if key not in req:
                raise ValueError(f"missing {key!r}")
    except ValueError as exc:
        print(json.dumps({"ok": False, "error": f"bad supervisor request: {exc}", "code": "bad_request"}))
        return 2
    return daemonize(req)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
