"""PNG plots of a bench report (matplotlib, Agg backend: no display needed).

Three pictures: throughput against batch size per method; "fast but wrong" (each method's
throughput, coloured by its exact match, so a method that is quick because it is corrupt stands out);
and where the wall time went (prefill / draft / verify / other) per method and batch size.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import BatchspecError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

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


EXACT_COLOR, WRONG_COLOR = "tab:green", "tab:red"
ROW_INCHES = 0.2  # height per method in the fast-but-wrong chart (7-point labels, never stacked)


def _fast_but_wrong(ax: Axes, entries: list[dict[str, Any]]) -> None:
    """One bar per method, fastest on top: its throughput, coloured and labelled by the share of its
    outputs equal to plain greedy decoding, so a method that is fast because it is wrong stands out in
    red however many exact methods run at about its speed. (A scatter of throughput against exactness
    put a dozen exact methods on one line at nearly one speed, labels crowded on leader lines.)"""
    ranked = sorted(entries, key=lambda e: e["tokens_per_s"])
    exact = [100 * (e["exact_match"] or 0.0) for e in ranked]
    y = range(len(ranked))
    colors = [EXACT_COLOR if share == 100 else WRONG_COLOR for share in exact]
    ax.figure.set_size_inches(ax.figure.get_figwidth(), max(5.0, 1.6 + ROW_INCHES * len(ranked)))
    ax.barh(y, [e["tokens_per_s"] for e in ranked], color=colors, height=0.7)
    ax.set_yticks(y, [e["method"] for e in ranked], fontsize=7)
    for i, (e, share) in enumerate(zip(ranked, exact)):
        ax.annotate(f"{share:.0f}% exact", (e["tokens_per_s"], i), textcoords="offset points", xytext=(3, 0),
                    fontsize=7, va="center", color="black" if share == 100 else WRONG_COLOR)
    ax.set_xlim(0, 1.18 * max((e["tokens_per_s"] for e in ranked), default=1.0))  # room for the labels
    ax.set_xlabel("generated tokens/s (end to end)")
    ax.set_title("Fast but wrong? Throughput, and outputs equal to plain greedy decoding")
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()


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
