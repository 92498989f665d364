"""A small stand-in job that honours the run-directory contract (docs/run-directory.md) for controller tests.

`python workload.py --output-dir DIR [--steps N] [--interval S] [--crash-at K] [--spawn-setsid]
[--resume-from CKPT]` prints one progress line per step, appends metrics.jsonl, rewrites status.json
atomically, and on SIGTERM writes `checkpoints/step_NNNNNN/state.json` and exits with EXIT_ON_SIGTERM (143).
`--ignore-term` makes it ignore SIGTERM (so `stop` must escalate to SIGKILL). `--slow-save S` makes the
checkpoint after SIGTERM take S seconds, with status.json phase "saving" and a live heartbeat meanwhile. `--crash-at K` raises at step K (a real traceback, exit 1). `--spawn-setsid` starts a child in its own
session (it keeps the environment, so only the run marker can find it) and writes its pid to child.pid.
For issue 17: `--save-every N` checkpoints every N steps (with `--ckpt-bytes B`, a B-byte `model.bin` of
seeded pseudo-random bytes beside state.json); `--crash-times N --state-file F` makes `--crash-at` fire only
in the first N starts (counted in F, which outlives the run directory: a supervisor's restarts share it);
`--crash-file F` crashes at the first step after F exists (a test's ordering, as --crash-at is a count);
`--hang-after K` stops all progress after step K (no step, no metrics, no status.json heartbeat) but still
honours SIGTERM, as a trainer whose loop is stuck in a collective; with `--beat-while-hung` its status.json
heartbeat keeps beating meanwhile (the trainer's heartbeat thread does), so only the missing steps show it.
`--check-only` validates the arguments and exits 0 (a profile's `check:`; a bad one exits 2, as argparse does).
Stdlib only; it never imports dflashops or trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

EXIT_ON_SIGTERM = 143


def write_status(out: str, **fields: object) -> None:
    tmp = os.path.join(out, "status.json.tmp")
    with open(tmp, "w") as handle:
        json.dump({"heartbeat": time.time(), **fields}, handle)
    os.replace(tmp, os.path.join(out, "status.json"))


def checkpoint(out: str, step: int, blob_bytes: int = 0) -> str:
    final = os.path.join(out, "checkpoints", f"step_{step:06d}")
    if os.path.isdir(final):
        return final  # this step was saved already (a SIGTERM right after a periodic save)
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "state.json"), "w") as handle:
        json.dump({"step": step}, handle)
    if blob_bytes:
        rng = random.Random(step)
        with open(os.path.join(tmp, "model.bin"), "wb") as handle:
            for start in range(0, blob_bytes, 1 << 20):
                handle.write(rng.randbytes(min(1 << 20, blob_bytes - start)))
    os.replace(tmp, final)
    return final


def starts_so_far(state_file: str | None) -> int:
    """How many times this workload started before (and count this start), from `state_file`."""
    if not state_file:
        return 0
    try:
        with open(state_file) as handle:
            before = int(handle.read().strip() or 0)
    except (OSError, ValueError):
        before = 0
    with open(state_file, "w") as handle:
        handle.write(f"{before + 1}\n")
    return before


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--spawn-setsid", action="store_true")
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (forces stop to escalate)")
    parser.add_argument("--slow-save", type=float, default=0.0, help="seconds the SIGTERM checkpoint takes")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only on SIGTERM)")
    parser.add_argument("--ckpt-bytes", type=int, default=0, help="size of each checkpoint's model.bin")
    parser.add_argument("--crash-file", default=None, help="crash at the first step after this file exists")
    parser.add_argument("--crash-times", type=int, default=-1, help="--crash-at fires only in the first N starts")
    parser.add_argument("--state-file", default=None, help="where --crash-times counts starts")
    parser.add_argument("--hang-after", type=int, default=-1, help="stop making progress after this step")
    parser.add_argument("--beat-while-hung", action="store_true", help="keep the heartbeat fresh while hung")
    parser.add_argument("--check-only", action="store_true", help="validate the arguments, start nothing, exit 0")
    args = parser.parse_args()
    if args.check_only:  # a profile's `check:` (argparse exits 2 with its own message on a bad argument)
        print("arguments ok", flush=True)
        return 0
    earlier_starts = starts_so_far(args.state_file)
    crash_armed = args.crash_times < 0 or earlier_starts < args.crash_times
    out = args.output_dir
    os.makedirs(out, exist_ok=True)
    stop_requested = []
    signal.signal(signal.SIGTERM, (lambda *_: None) if args.ignore_term else (lambda *_: stop_requested.append(True)))
    start = 0
    if args.resume_from:
        with open(os.path.join(args.resume_from, "state.json")) as handle:
            start = json.load(handle)["step"]
        print(f"resumed from {args.resume_from} at step {start}", flush=True)
    if args.spawn_setsid:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], start_new_session=True
        )
        with open(os.path.join(out, "child.pid"), "w") as handle:
            handle.write(f"{child.pid}\n")
    print(f"secret present: {'WORKLOAD_SECRET' in os.environ}", flush=True)
    step = start
    while step < args.steps:
        while step == args.hang_after and not stop_requested:
            time.sleep(0.05)  # stuck: no step, no metrics, no heartbeat (unless --beat-while-hung)
            if args.beat_while_hung:
                write_status(out, phase="training", step=step)
        if stop_requested:
            saving_until = time.monotonic() + args.slow_save
            while time.monotonic() < saving_until:  # as the trainer's heartbeat thread does while it saves
                write_status(out, phase="saving", step=step)
                time.sleep(0.1)
            path = checkpoint(out, step, args.ckpt_bytes)
            write_status(out, phase="stopped", step=step, last_checkpoint=path)  # as trainer.core.signals does
            print(f"SIGTERM: checkpoint {path}, exiting {EXIT_ON_SIGTERM}", flush=True)
            return EXIT_ON_SIGTERM
        step += 1
        crash_now = step == args.crash_at or bool(args.crash_file and os.path.exists(args.crash_file))
        if crash_now and crash_armed:
            write_status(out, phase="failed", step=step, error="RuntimeError: injected crash")
            raise RuntimeError(f"injected crash at step {step}")
        loss = 10.0 / step
        with open(os.path.join(out, "metrics.jsonl"), "a") as handle:
            handle.write(json.dumps({"step": step, "loss": loss, "tau_sim": 1.0 + step / 100}) + "\n")
        if args.save_every and step % args.save_every == 0:
            checkpoint(out, step, args.ckpt_bytes)
        write_status(out, phase="training", step=step)
        print(f"step {step} loss {loss:.4f}", flush=True)
        time.sleep(args.interval)
    write_status(out, phase="done", step=step)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
