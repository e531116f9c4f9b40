"""PNG plots of a bench report (matplotlib, Agg backend: no display needed).

Three pictures: throughput against batch size per method; "fast but wrong" (throughput against
exact match, so a method that is quick because it is corrupt stands out at the bottom right); and
where the wall time went (prefill / draft / verify / other) per method and batch size.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..config import BatchspecError

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
        draw(ax, ok)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
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
    ax.legend(fontsize=8)


def _fast_but_wrong(ax: Axes, entries: list[dict[str, Any]]) -> None:
    for n, e in enumerate(sorted(entries, key=lambda e: e["tokens_per_s"])):
        exact = 100 * (e["exact_match"] or 0.0)
        ax.scatter(e["tokens_per_s"], exact, s=40)
        # alternate label offsets: exact methods all sit on the 100% line and would overprint
        ax.annotate(e["method"], (e["tokens_per_s"], exact), textcoords="offset points",
                    xytext=(4, 5 if n % 2 == 0 else -11), fontsize=7)
    ax.set_xlabel("generated tokens/s (end to end)")
    ax.set_ylabel("exact match vs plain greedy (%)")
    ax.set_ylim(-5, 105)
    ax.set_title("Fast but wrong? Throughput vs exactness")
    ax.grid(alpha=0.3)


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
    ax.legend(fontsize=8)
