"""PNG plots of a bench report (matplotlib, Agg backend: no display needed).

Three pictures: throughput against batch size per method; "fast but wrong" (throughput against
exact match, so a method that is quick because it is corrupt stands out at the bottom right); and
where the wall time went (prefill / draft / verify / other) per method and batch size.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..config import BatchspecError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.text import Annotation

PHASES = ("prefill", "draft", "verify", "other")


def _pyplot() -> ModuleType:
    """pyplot on the Agg backend, imported only when plots are asked for (matplotlib is slow to import)."""
    try:
        import matplotlib
    except ImportError:
        raise BatchspecError("--plots needs matplotlib: pip install matplotlib==3.11.2") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(directory: str | Path, entries: list[dict[str, Any]], title: str) -> list[Path]:
    """Write the three plots into `directory`; returns their paths."""
    plt = _pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ok = [e for e in entries if e["error"] is None and e["tokens_per_s"] is not None]
    paths = [out / "throughput_vs_batch.png", out / "fast_but_wrong.png", out / "time_breakdown.png"]
    for path, draw in zip(paths, (_throughput, _fast_but_wrong, _breakdown)):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        fig.suptitle(textwrap.fill(title, width=110), fontsize=9)  # a long title wraps instead of running off
        draw(ax, ok)  # settles the layout itself: labels are placed in the final coordinates
        fig.savefig(path)
        plt.close(fig)
    return paths


def _throughput(ax: Axes, entries: list[dict[str, Any]]) -> None:
    families: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        families.setdefault(e["family"], []).append(e)
    for family, points in families.items():
        points.sort(key=lambda e: e["batch_size"])
        ax.plot([e["batch_size"] for e in points], [e["tokens_per_s"] for e in points], marker="o", label=family)
    sizes = sorted({e["batch_size"] for e in entries})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s (end to end)")
    ax.set_title("Throughput vs batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()


def _fast_but_wrong(ax: Axes, entries: list[dict[str, Any]]) -> None:
    points = [(e["tokens_per_s"], 100 * (e["exact_match"] or 0.0)) for e in entries]
    ax.scatter([x for x, _ in points], [y for _, y in points], s=30, zorder=3)
    ax.set_xlabel("generated tokens/s (end to end)")
    ax.set_ylabel("exact match vs plain greedy (%)")
    ax.set_ylim(-5, 105)
    ax.set_title("Fast but wrong? Throughput vs exactness")
    ax.grid(alpha=0.3)
    ax.figure.tight_layout()
    place_labels(ax, points, [e["method"] for e in entries])


LABEL_STEP = 11  # points between stacked labels (7-point text)
MARKER_PIXELS = 5  # half the size of a marker: labels keep off every point, not only off each other


def _label_spots(count: int) -> list[tuple[int, int]]:
    """Offsets (points) to try for a label: up-right of its point, then stepping away below and
    above alternately, then the same on the left."""
    right = [(5, 4)] + [(5, 4 + sign * LABEL_STEP * i) for i in range(1, count + 1) for sign in (-1, 1)]
    return right + [(-dx, dy) for dx, dy in right]


def place_labels(ax: Axes, points: list[tuple[float, float]], labels: list[str]) -> list[Annotation]:
    """Label each point so that no two labels overlap and all stay inside the axes: many correct
    methods share the 100% line at similar speeds, where fixed offsets print labels on top of each
    other. Each label takes the first free spot of `_label_spots`; one moved off its point gets a
    leader line. Markers count as taken space too. Call once the figure's layout is final (positions
    are checked in display space)."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pad = MARKER_PIXELS
    taken = [Bbox.from_extents(x - pad, y - pad, x + pad, y + pad) for x, y in ax.transData.transform(points)]
    placed = []
    order = sorted(range(len(points)), key=lambda i: (-points[i][1], points[i][0]))
    for i in order:
        spots = _label_spots(len(points))
        for spot in spots:
            label = ax.annotate(labels[i], points[i], textcoords="offset points", xytext=spot, fontsize=7,
                                ha="left" if spot[0] > 0 else "right", va="center")
            box = label.get_window_extent(renderer)
            free = not any(box.overlaps(other) for other in taken)
            if free and frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) or spot == spots[-1]:
                break
            label.remove()
        if spot != spots[0]:
            label.remove()
            label = ax.annotate(labels[i], points[i], textcoords="offset points", xytext=spot, fontsize=7,
                                ha="left" if spot[0] > 0 else "right", va="center",
                                arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6, "shrinkA": 0, "shrinkB": 2})
        taken.append(box)
        placed.append(label)
    return placed


def _breakdown(ax: Axes, entries: list[dict[str, Any]]) -> None:
    timed = [e for e in entries if e["time_share"] is not None]
    names = [e["method"] for e in timed]
    bottom = [0.0] * len(timed)
    for phase in PHASES:
        seconds = [e["time_share"][phase] * e["wall_s"] for e in timed]
        ax.bar(names, seconds, bottom=bottom, label=phase)
        bottom = [b + s for b, s in zip(bottom, seconds)]
    ax.set_ylabel("wall time (s)")
    ax.set_title("Where the time went (HF baselines have no breakdown)")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
