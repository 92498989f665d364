"""Loss / tau_sim / throughput curves of several runs in one PNG, readable without colour.

Each run gets its own line style AND marker AND a text label at the end of its line (plus the legend), so
a greyscale print or a colour-blind reader can tell the lines apart. matplotlib is imported lazily (it costs
~0.3 s and the rest of the CLI must not pay it) and drawn through the Agg canvas directly, never pyplot, so
no GUI backend or global figure state is involved.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflashops.core.errors import MissingDependency, UsageError

LINE_STYLES: tuple[str | tuple[int, tuple[int, ...]], ...] = (
    "-",
    "--",
    ":",
    "-.",
    (0, (5, 1, 1, 1, 1, 1)),
    (0, (8, 2)),
    (0, (1, 3)),
    (0, (3, 1, 3, 1, 1, 1)),
)
MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "x", "P", "*")
# Okabe-Ito palette: distinguishable for the common colour-vision deficiencies (styles carry the meaning).
COLOURS: tuple[str, ...] = ("#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#777777")
MARKERS_PER_LINE = 8  # markers on every point of a 10k-step run would be a solid smear


def style_for(index: int) -> dict[str, Any]:
    """Line style, marker and colour of the index-th run: the (style, marker) pair differs for 64 runs."""
    return {
        "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
        "marker": MARKERS[(index + index // len(LINE_STYLES)) % len(MARKERS)],
        "color": COLOURS[index % len(COLOURS)],
    }


def require_matplotlib() -> None:
    """MissingDependency (with the install line) unless matplotlib imports: only the `plot` and `dev`
    extras install it, and `runs plot` must say so before it reads anything, not end in a traceback."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(
            f"runs plot needs matplotlib, which cannot be imported here ({exc})", hint="pip install 'dflashops[plot]'"
        ) from None


def plot_runs(
    series_by_run: Mapping[str, Sequence[tuple[int, float]]],
    metric: str,
    out: Path,
    *,
    title: str | None = None,
    log_y: bool = False,
) -> Path:
    """Draw one line per run (step on x, `metric` on y) and write a PNG to `out` atomically.

    Raises UsageError when no run has any point, or `out` is not a .png path in an existing folder.
    Runs with an empty series are left out (the caller reports them).
    """
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UsageError(f"--out must name a .png file, not {str(out)!r}", hint="e.g. --out loss.png")
    if not out.parent.is_dir():
        raise UsageError(f"folder {out.parent} does not exist", hint="create it or choose another --out")
    drawn = {name: points for name, points in series_by_run.items() if points}
    if not drawn:
        raise UsageError(f"none of the runs has any {metric!r} value to plot")

    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: see module doc
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    for index, (name, points) in enumerate(drawn.items()):
        steps = [step for step, _ in points]
        values = [value for _, value in points]
        style = style_for(index)
        every = max(1, len(points) // MARKERS_PER_LINE)
        axes.plot(
            steps, values, label=name, linewidth=1.8, markersize=6, markevery=every, markerfacecolor="white", **style
        )
        axes.annotate(
            f" {name}",
            (steps[-1], values[-1]),
            fontsize=8,
            color=style["color"],
            va="center",
            ha="left",
            annotation_clip=False,
        )
    if log_y:
        axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.set_title(title or f"{metric} by step")
    axes.grid(True, linestyle=":", linewidth=0.6, color="#999999")
    axes.legend(loc="best", frameon=True, fontsize=9, handlelength=4)
    axes.margins(x=0.12)  # room for the end-of-line labels
    figure.tight_layout()
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(temporary, format="png")
        os.replace(temporary, out)  # a reader (image viewer, CI artifact upload) never sees half a PNG
    finally:
        temporary.unlink(missing_ok=True)
    return out
