"""The whole restart cycle of a run, as a user waits through it, through the CLI on the local target (issue 20).

    python bench/restart_cycle.py                                   # 8B-shaped pipeline on cuda:0 (the H200 run)
    .venv/bin/python bench/restart_cycle.py --scale smoke --device cpu --modes handover,wait-exit   # CPU smoke test

What it does, in a scratch folder (--workdir): writes fixed-length token shards and a random Qwen3 target of the
scale's shape saved with save_pretrained (safetensors, so the child loads it the way a real target is loaded),
an inventory with one `local` target and one profile (`python -m trainer train --pipeline`, one target thread
and two drafter threads on one device, every checkpoint only on a stop), then through `dflashops`:

  deploy c1 (cold compile cache), follow it to step --steps, then for each mode in --modes:
  `dflashops restart cK --name cK+1 --resume [--wait-exit]`, follow the child to its first optimizer step + a few

and reads the milestones both trainers record in status.json (`timeline`, trainer.state.metrics.RunRecorder.mark), the
wrapper's `pid` file (when the job was spawned) and `exit_code` (when the old process ended). Per restart it
prints where the seconds from `restart` typed to the child's first step went:

  stop:   typed -> the old trainer agreed to stop (finishes its step) -> final snapshot in host memory ->
          devices released (hand-over offered) ... final checkpoint written -> old process exited
  start:  typed -> restart returned -> job spawned (a standby interpreter: imports done already) -> python
          up -> imports -> pre-flight -> build (target, drafters) -> compiled (warm-up for the batch shapes ahead,
          warm compile cache: same code hash; before the checkpoint is read) -> checkpoint ready (waited for the
          old writer's data) -> resumed (read + loaded) -> worker threads started -> first step

`handover` is the default restart (trainer/state/handover.py: the child starts once the old trainer's devices are free);
`wait-exit` the old order (the child starts after the old process exited); `code-change-outside` (alias
`code-change`) a hand-over restart after a change of the code outside the compiled code (one file added to the
trainer package, removed again once `restart` returned): a new release, which compiles nothing since the compile
cache is shared by code versions; `code-change-inside` the same after a change inside the drafter's forward (its
MLP multiplies by 1.0: the same numbers, another traced graph), which recompiles only the layer graphs;
`bad-code` and `bad-flag` a restart with a syntax error (a new file that does not compile) or a bad trainer flag,
refused by the pre-flight: the row says how long the refusal took and that the old run kept training (the next
restart goes on from that run). With `--fresh-workspace`, after the modes: a deploy into a new workspace whose
compile cache holds only the artifacts the runs above saved (`<key>.artifacts.d/`, trainer/core/compile_cache.py),
as a fresh container would get them, with the standby on (the deploy starts one, checks in it and adopts it),
followed to its first step. Checks: each child resumed from the old run's
final checkpoint at the step it stopped at, the old run ended with exit code 143, a refused restart left its old
run running.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from gpu_pipeline import SCALES, shape_flags, target_shape, write_shards  # noqa: E402

CACHE_DIR_SET_BY_HAND = "TORCHINDUCTOR_CACHE_DIR" in os.environ  # before torch sets its default in this process
CHANGE = ROOT / "trainer" / "_restart_cycle_change.py"  # `--modes code-change-outside`: one file added to the release
DRAFTER = ROOT / "trainer" / "model" / "drafter.py"  # `--modes code-change-inside` edits its MLP for one restart
MLP_LINE = "        return self.down_proj(F.silu(self.gate_proj(xg)) * self.up_proj(xu))\n"
MLP_EDITED = "        return self.down_proj(F.silu(self.gate_proj(xg)) * self.up_proj(xu) * 1.0)\n"
START = [
    "python_started",
    "imports_done",
    "preflight_done",
    "built",
    "compiled",
    "checkpoint_ready",
    "resumed",
    "warmed_up",
    "first_step",
]


def save_target(directory: Path, scale: dict, device: str) -> float:
    """A random Qwen3 of the scale's target shape, saved in bf16 safetensors; returns the bytes written."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**target_shape(scale), tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def train_flags(work: Path, scale: dict, device: str) -> list[str]:
    """`python -m trainer train` flags of the cycle's run (no --output-dir): one target thread and two drafter
    threads on `device`, checkpoints only on a stop."""
    return [
        "--preset",
        "tiny",
        "--target-model",
        str(work / "target"),
        "--data-dir",
        str(work / "data"),
        "--pipeline",
        "--target-gpus",
        device,
        "--drafter-gpus",
        f"{device},{device}",
        "--max-steps",
        "100000",
        "--log-interval",
        "5",
        "--save-interval",
        "1000000",
        "--wandb",
        "off",
        *shape_flags(scale),
    ]


def write_inventory(work: Path, scale: dict, device: str, standby: bool = True) -> Path:
    argv = ["{python}", "-m", "trainer", "train", "--output-dir", "{run_dir}", *train_flags(work, scale, device)]
    inventory = work / "inventory.yaml"
    inventory.write_text(
        json.dumps(
            {  # JSON is YAML
                "targets": {
                    "local": {
                        "kind": "local",
                        "workspace": str(work / "ws"),
                        "python": sys.executable,
                        "standby": standby,
                        "env": {
                            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                            "PYTHONUNBUFFERED": "1",
                            # On the CPU (the smoke test) each step takes >= 0.1 s (trainer/training/loop.py): the old run
                            # trains on beside each restart, and unpaced its three threads took the cores the
                            # child builds on (a third of the test suite's CPU time went to this bench).
                            **({"TRAINER_TEST_MIN_STEP_S": "0.1"} if device == "cpu" else {}),
                        },
                    }
                },
                "profiles": {"cycle": {"argv": argv, "resume_args": ["--resume", "{checkpoint}"]}},
            },
            indent=1,
        )
    )
    return inventory


def cli(inventory: Path, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not CACHE_DIR_SET_BY_HAND:  # torch set it in this process (save_target): it is no choice for the runs
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", "dflashops", "--inventory", str(inventory), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if check and result.returncode != 0:
        raise SystemExit(f"dflashops {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def wait(predicate, timeout: float, what: str, run_dir: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or ((run_dir / "exit_code").is_file() and not predicate()):
            log = (run_dir / "train.log").read_text()[-3000:] if (run_dir / "train.log").is_file() else ""
            raise SystemExit(f"{what}: not reached within {timeout:.0f} s (or the run ended)\n{log}")
        time.sleep(0.1)


def mtime(path: Path) -> float | None:
    return path.stat().st_mtime if path.exists() else None


def ready_standby(workspace: Path, timeout: float) -> int | None:
    """The pid of the workspace's ready standby interpreter (dflashops/agent/standby.py), waiting up to `timeout` s for
    one (it imports once the run it follows has taken its first step); None without one."""
    deadline = time.monotonic() + timeout
    while True:
        for ready in sorted((workspace / "standby").glob("*/ready")):
            if (ready.parent / "claimed").exists():  # adopted by a running run, or on its way out
                continue
            try:
                return int(ready.read_text())
            except (OSError, ValueError):
                pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def restart_row(mode: str, typed: float, returned: float, old_dir: Path, new_dir: Path, standby: int | None) -> dict:
    old, new = status(old_dir), status(new_dir)
    told, tnew = old.get("timeline", {}), new.get("timeline", {})
    rel = lambda t: None if t is None else round(t - typed, 2)  # noqa: E731
    row: dict = {
        "mode": mode,
        "standby": standby is not None and (new_dir / "pid").read_text().strip() == str(standby),
        "returned": rel(returned),
        "old_exit_code": (old_dir / "exit_code").read_text().strip(),
        "stop_agreed": rel(told.get("stop_agreed")),
        "final_snapshot": rel(told.get("final_snapshot")),
        "devices_released": rel(told.get("devices_released")),
        "final_written": rel(told.get("ended")),
        "old_exited": rel(mtime(old_dir / "exit_code")),
        "spawned": rel(mtime(new_dir / "pid")),
        **{k: rel(tnew.get(k)) for k in START},
        "handover": old.get("handover"),
    }
    log = (new_dir / "train.log").read_text()
    build = [line for line in log.splitlines() if line.startswith("built in ")]
    row["build_line"] = build[0] if build else None
    row["resumed_line"] = next((line for line in log.splitlines() if line.startswith("resumed from")), None)
    row["stopped_at"] = old.get("step")
    row["compile_cache"] = new.get(
        "compile_cache"
    )  # graphs reused / compiled by the child (trainer.core.compile_cache)
    return row


def refused_row(mode: str, inventory: Path, old: str, old_dir: Path) -> dict:
    """A restart the pre-flight must refuse: how long until the error, and whether the old run kept training."""
    extra: list[str] = ["--", "--max-steps", "abc"] if mode == "bad-flag" else []
    if mode == "bad-code":
        CHANGE.write_text("def broken(:\n    pass\n")
    typed = time.time()
    try:
        done = cli(inventory, "restart", old, "--resume", "--grace", "300", *extra, check=False)
    finally:
        CHANGE.unlink(missing_ok=True)
    refused_in = round(time.time() - typed, 2)
    step = status(old_dir).get("step", 0)
    wait(lambda: status(old_dir).get("step", 0) > step, 120, f"{old} training on", old_dir)
    error = next((ln for ln in done.stderr.splitlines() if ln.startswith("error: ")), None)
    return {"mode": mode, "refused": done.returncode == 2, "refused_in": refused_in, "error": error,
            "old_trains_on": not (old_dir / "exit_code").exists()}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="8b", choices=sorted(SCALES))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--modes", default="handover,wait-exit,handover,wait-exit")
    parser.add_argument("--steps", type=int, default=10, help="steps each run trains before it is restarted")
    parser.add_argument("--workdir", default="/tmp/restart-cycle")
    parser.add_argument("--json-out")
    parser.add_argument(
        "--no-standby", action="store_true", help="no standby interpreter: every child imports torch itself"
    )
    parser.add_argument(
        "--prune-checkpoints",
        action="store_true",
        help="remove each old run's checkpoints once its child has resumed (an 8B-shaped cycle fills a 64 GB disk)",
    )
    parser.add_argument(
        "--fresh-workspace",
        action="store_true",
        help="after the modes: a deploy into a new workspace that has only the compile artifacts of the runs above",
    )
    args = parser.parse_args()
    scale, work = SCALES[args.scale], Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    # Runs of an earlier call (each keeps its final checkpoint: 12.6 GB at the 8B shape) would fill the disk; the
    # target and data are kept. Its standbys, if any, exit when their folder is gone.
    shutil.rmtree(work / "ws", ignore_errors=True)
    t = time.monotonic()
    if not (work / "data" / "meta.json").exists():
        write_shards(work / "data", scale, samples=scale["rows"] * 2 * 400)
    if not (work / "target" / "config.json").exists():
        size = save_target(work / "target", scale, args.device)
        print(f"target: {size / 1e9:.2f} GB of safetensors written in {time.monotonic() - t:.1f} s", file=sys.stderr)
    inventory = write_inventory(work, scale, args.device, standby=not args.no_standby)
    runs = work / "ws" / "runs"
    # Its runs and standbys live in sessions of their own (setsid): a bench that ended early (a failed wait, a
    # SIGTERM from its caller's timeout) left them training, reparented to PID 1. Stopped on every exit but SIGKILL.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    atexit.register(stop_what_is_left, inventory, work / "ws")
    name = f"c{int(time.time()) % 100000}-1"
    started = time.time()
    cli(inventory, "deploy", "local", "--profile", "cycle", "--name", name, "--launcher", "nohup")
    wait(lambda: status(runs / name).get("step", 0) >= args.steps, 900, f"{name} step {args.steps}", runs / name)
    cold = status(runs / name)["timeline"]
    print(
        f"cold start ({name}): first step {cold['first_step'] - started:.1f} s after deploy typed; "
        f"build {cold['built'] - cold['preflight_done']:.1f} s, warm-up {cold['warmed_up'] - cold['built']:.1f} s",
        file=sys.stderr,
    )
    rows, refused = [], []
    print(f"cold compile: {json.dumps(status(runs / name).get('compile_cache'))}", file=sys.stderr)
    for k, mode in enumerate(args.modes.split(",")):
        old, new = name, f"{name.rsplit('-', 1)[0]}-{k + 2}"
        if mode in ("bad-code", "bad-flag"):
            refused.append(refused_row(mode, inventory, old, runs / old))
            print(json.dumps(refused[-1]), file=sys.stderr)
            continue
        standby = None if args.no_standby else ready_standby(work / "ws", 300)
        if mode in ("code-change", "code-change-outside"):  # a new release; the shared cache has all its graphs
            CHANGE.write_text(
                f"# bench/restart_cycle.py: a code change for restart {k + 1}\nCHANGED_AT = {time.time()!r}\n"
            )
        if mode == "code-change-inside":  # the layers' traced graph changes: those recompile, the rest is reused
            source = DRAFTER.read_text()
            assert source.count(MLP_LINE) == 1, "the MLP line this mode edits has changed: update MLP_LINE"
            DRAFTER.write_text(source.replace(MLP_LINE, MLP_EDITED))
        typed = time.time()
        cli(
            inventory,
            "restart",
            old,
            "--name",
            new,
            "--resume",
            "--grace",
            "300",
            *(["--wait-exit"] if mode == "wait-exit" else []),
        )
        returned = time.time()
        CHANGE.unlink(missing_ok=True)  # shipped with the release already; the checkout stays as it was
        if mode == "code-change-inside":
            DRAFTER.write_text(DRAFTER.read_text().replace(MLP_EDITED, MLP_LINE))
        new_dir, old_dir = runs / new, runs / old
        wait(lambda: "first_step" in status(new_dir).get("timeline", {}), 600, f"{new} first step", new_dir)  # noqa: B023 - called here
        wait(lambda: (old_dir / "exit_code").is_file(), 600, f"{old} exit", old_dir)  # noqa: B023 - called here
        row = restart_row(mode, typed, returned, runs / old, runs / new, standby)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        until = row["stopped_at"] + args.steps
        wait(lambda: status(new_dir).get("step", 0) >= until, 600, f"{new} {args.steps} steps", new_dir)  # noqa: B023 - called here
        if args.prune_checkpoints:  # the child has resumed: the old run's 12.6 GB are not needed (disk: 64 GB)
            shutil.rmtree(old_dir / "checkpoints", ignore_errors=True)
        name = new
    cli(inventory, "stop", name, "--grace", "300")
    from dflashops.agent.standby import retire_standbys

    retire_standbys(str(work / "ws"), keep=None)  # the last run's standby: not needed after the bench
    fresh = fresh_workspace(work, scale, args.device, args.steps) if args.fresh_workspace else None
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"cold": cold, "rows": rows, "refused": refused, "fresh": fresh}, indent=1)
        )
    ok = all(
        r["old_exit_code"] == "143" and r["resumed_line"] and f"at step {r['stopped_at']}" in r["resumed_line"]
        for r in rows
    ) and all(r["refused"] and r["old_trains_on"] for r in refused)
    cols = [
        "mode",
        "standby",
        "stop_agreed",
        "final_snapshot",
        "devices_released",
        "returned",
        "spawned",
        "imports_done",
        "preflight_done",
        "built",
        "compiled",
        "final_written",
        "checkpoint_ready",
        "resumed",
        "warmed_up",
        "first_step",
        "old_exited",
    ]
    print("seconds after `restart` was typed:")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row.get(c)) for c in cols))
    for row in rows:
        print(f"{row['mode']}: compile cache {json.dumps(row.get('compile_cache'))}")
    for row in refused:
        print(
            f"{row['mode']}: refused in {row['refused_in']} s, old run trains on: {row['old_trains_on']}: {row['error']}"
        )
    if fresh is not None:
        print(f"fresh workspace: first step {fresh['first_step']} s after deploy typed; compile cache {fresh['cache']}")
    print("resumed from the old run's final checkpoint at its stop step, old exit 143:", "yes" if ok else "NO")
    return 0 if ok else 1


def stop_what_is_left(inventory: Path, workspace: Path) -> None:
    """Stop every run of `workspace` that has not ended (`dflashops stop --now`: its own process group, no final
    checkpoint) and retire its standby interpreters. A no-op after a bench that ended as planned."""
    runs = workspace / "runs"
    for run in sorted(runs.iterdir()) if runs.is_dir() else []:
        if (run / "pgid").exists() and not (run / "exit_code").exists():
            cli(inventory, "stop", run.name, "--now", timeout=120, check=False)
    from dflashops.agent.standby import retire_standbys

    retire_standbys(str(workspace), keep=None)


def fresh_workspace(work: Path, scale: dict, device: str, steps: int) -> dict:
    """A deploy into a new workspace whose compile cache root holds only the `<key>.artifacts.d/` folder of the runs
    above (what a fresh container of the same GPU kind gets), to its first step: seconds and cache counters."""
    fresh = work / "ws-fresh"
    shutil.rmtree(fresh, ignore_errors=True)
    (fresh / "cache" / "compile").mkdir(parents=True)
    carried = sorted((work / "ws" / "cache" / "compile").glob("*.artifacts.d"))
    for artifacts in carried:
        shutil.copytree(artifacts, fresh / "cache" / "compile" / artifacts.name)
    inventory = write_inventory(work, scale, device)  # the standby on: the deploy starts one and adopts it
    text = json.loads(inventory.read_text())
    text["targets"]["local"]["workspace"] = str(fresh)
    inventory.write_text(json.dumps(text, indent=1))
    typed = time.time()
    cli(inventory, "deploy", "local", "--profile", "cycle", "--name", "fresh-1", "--launcher", "nohup")
    run = fresh / "runs" / "fresh-1"
    wait(lambda: "first_step" in status(run).get("timeline", {}), 900, "fresh-1 first step", run)
    first = round(status(run)["timeline"]["first_step"] - typed, 2)
    cache = status(run).get("compile_cache")
    cli(inventory, "stop", "fresh-1", "--now")  # its final checkpoint is of no use here
    from dflashops.agent.standby import retire_standbys

    retire_standbys(str(fresh), keep=None)  # the one started for the next launch
    write_inventory(work, scale, device)  # as it was
    row = {
        "first_step": first,
        "cache": cache,
        "artifacts": [f"{a.name}/{f.name}" for a in carried for f in a.iterdir()],
    }
    print(json.dumps({"fresh": row}), file=sys.stderr)
    return row


if __name__ == "__main__":
    sys.exit(main())
