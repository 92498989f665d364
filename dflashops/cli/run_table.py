"""The one table of runs that `status`, `status --all` and `watch` print (rows are ops/observe/watch.py RunRows).

Layout: a header row, then running runs (launching, running, stopping) first and ended runs after them. An
ended run shows its end state (crashed, lost, finished, stopped) and its exit code, and no eta or heartbeat
age (they stopped meaning anything when it ended). Below the table one line per run says its error, or else
its last log line (wandb's housekeeping lines are skipped by the agent). States are words, so the table
means the same without colour; colour only on a terminal and never with NO_COLOR.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from dflashops.ops.observe.watch import LIVE_STATES as LIVE
from dflashops.ops.observe.watch import GpuRow, RunRow

COLUMNS = ("run", "target", "state", "step", "loss", "tau_sim", "blk tok/s", "eta", "beat", "exit")


def ordered(rows: list[RunRow]) -> list[RunRow]:
    """Running runs first, then ended ones; each group in the order given."""
    return [row for row in rows if row.state in LIVE] + [row for row in rows if row.state not in LIVE]


def _num(value: float | None, decimals: int = 0) -> str:
    """One format per column, as the trainer's log line writes it (loss 4 decimals, tau_sim 3, tok/s a whole
    number with thousands separators): `4 significant digits` gave 5.139, 1.02, 450 and 1,234 side by side."""
    if value is None:
        return "-"
    return f"{value:,.{decimals}f}"


def _eta(seconds: float | None, limit: str | None = None) -> str:
    """`0:01:23`, and which limit it runs to when the trainer said: `(max-steps)` or `(epochs)` (a --max-steps
    the data's epochs cap reads `(epochs)`: the run ends sooner than that flag says)."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    shown = f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    return f"{shown} ({limit.replace('_', '-')})" if limit else shown


def state_text(row: RunRow) -> str:
    state = row.state
    if row.state == "running" and row.phase and row.phase != "training":
        state = f"running ({row.phase})"
    if row.restarted_as:
        state += f" -> auto-restarted as {row.restarted_as}"
    elif row.supervision and (row.state in LIVE or row.supervision.startswith("supervisor died")):
        state += f" ({row.supervision})"  # a helper that went silent is said, never shown by colour alone
    return state


def runs_table(rows: list[RunRow], title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for column in COLUMNS:
        table.add_column(column, no_wrap=True)
    for row in ordered(rows):
        live = row.state in LIVE
        step = "-" if row.step is None else (f"{row.step}/{row.total_steps}" if row.total_steps else str(row.step))
        table.add_row(
            row.name,
            row.target or "-",
            Text(state_text(row), style="bold red" if row.state in ("crashed", "lost", "unreachable") else ""),
            step,
            _num(row.loss, 4),
            _num(row.tau_sim, 3),
            _num(row.block_tok_s),
            _eta(row.eta_s, row.step_limit) if live else "-",
            "-" if row.heartbeat_age_s is None or not live else f"{row.heartbeat_age_s:.0f}s",
            "-" if row.exit_code is None else str(row.exit_code),
        )
    return table


def detail_lines(row: RunRow) -> list[str]:
    """The run's facts beyond the table (per-drafter tok/s, queues, GPU memory), then its error or last log
    line: `RUN error: ...` (an error line that starts with `error: ` already is not prefixed twice)."""
    lines = []
    facts = [
        f"drafters {' '.join(_num(v) for v in row.block_tok_s_per_drafter)} tok/s"
        if row.block_tok_s_per_drafter
        else "",
        f"queues {' '.join(f'{k}={v}' for k, v in row.queues.items())}" if row.queues else "",
        f"gpu mem {' '.join(f'{k}:{v:.1f}GB' for k, v in row.gpu_mem_gb.items())}" if row.gpu_mem_gb else "",
    ]
    if any(facts) and row.state in LIVE:
        lines.append(f"{row.name}: " + " | ".join(f for f in facts if f))
    if row.error_line:
        lines.append(f"{row.name} error: {row.error_line.strip().removeprefix('error: ')}")
    else:
        lines.append(f"{row.name} log: {(row.last_log_line or '-').strip()}")
    return lines


def gpu_table(gpus: list[GpuRow]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for column in ("gpu", "name", "memory MiB", "util %"):
        table.add_column(column, no_wrap=True)
    for gpu in gpus:
        table.add_row(
            f"{gpu.target}:{gpu.index}",
            gpu.name,
            f"{gpu.memory_used_mib}/{gpu.memory_total_mib}",
            str(gpu.utilization_pct),
        )
    return table
