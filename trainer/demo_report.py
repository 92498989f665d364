"""The demos' acceptance report (the synthetic `trainer demo` and the real-model `trainer/real_demo.py`): the table,
the checks a demo passes or fails, and the budget lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.core import run_files


def run_tokens(run: Path, block_size: int) -> dict[str, int]:
    """The real blocks the run trained on and their tokens (blocks x B), summed over metrics.jsonl's windows
    (each record sums the steps since the previous one)."""
    blocks = sum(int(json.loads(line).get("blocks", 0)) for line in (run / run_files.METRICS).read_text().splitlines())
    return {"blocks": blocks, "block_tokens": blocks * block_size}


def compare_line(reports: dict[str, dict]) -> str:
    """One line: DFlash2's held-out tau against DFlash's, at the same steps (and data), with their wall times."""
    a, b = reports["dflash"], reports["dflash2"]
    ta, tb = a["methods"]["trained"]["tau"], b["methods"]["trained"]["tau"]
    unary = b["methods"].get("trained_unary", {}).get("tau")
    return (
        f"dflash2 tau {tb:.2f} vs dflash {ta:.2f} on held-out prompts: {tb / ta:.2f}x "
        f"(dflash2 without its selector: {unary:.2f}); {a['budget']['steps']} steps and "
        f"{a['budget']['block_tokens']} vs {b['budget']['block_tokens']} block tokens each, "
        f"train wall {b['budget']['train_seconds']:.0f}s vs {a['budget']['train_seconds']:.0f}s"
    )


def print_and_check(report: dict, margin: float | None, seen_count: int) -> int:
    """The acceptance table and the demo's two checks for one trained drafter: 0, or 1 when it fails one.
    margin None: the drafter against the best baseline is reported, not checked (the real world's tiny test size,
    whose 4 steps learn nothing); the lossless check always holds."""
    from trainer.evaluation import eval as eval_mod

    print(eval_mod.format_table(report))
    taus = {name: m["tau"] for name, m in report["methods"].items()}
    best_baseline = max(taus["untrained"], taus["ngram"])
    seen_tau = report["training_prompts"]["tau"]
    print(
        f"trained tau on {seen_count} training prompts {seen_tau:.2f}, on held-out prompts "
        f"{taus['trained']:.2f} (the difference is generalisation to unseen prompts)"
    )
    required = "not checked" if margin is None else f"margin required {margin:.2f}"
    print(
        f"trained tau {taus['trained']:.2f} vs best baseline {best_baseline:.2f} "
        f"({required}); lossless: {'yes' if report['lossless'] else 'NO'}"
    )
    if not (report["lossless"] and report["training_prompts"]["lossless"]):
        print("error: speculative output differs from the target's greedy output", file=sys.stderr)
        return 1
    if margin is None:
        verdict = "beats" if taus["trained"] > best_baseline else "does not beat"
        print(f"at this budget the trained drafter {verdict} the best baseline (the goal is to beat it)")
    elif taus["trained"] < best_baseline + margin:
        print("error: the trained drafter does not beat both baselines by the required margin", file=sys.stderr)
        return 1
    return 0
