"""Layouts map rows (sequences in flight) onto one model's KV buffer: positions, masks, write slots.

Which method runs on which layout is the method registry's business (`batchspec.methods`).
"""

from .base import Layout, LayoutView
from .padded import PaddedLayout
from .ragged import RaggedLayout

__all__ = ["LAYOUTS", "Layout", "LayoutView", "PaddedLayout", "RaggedLayout", "make_layout"]

# `padded` is the paper's EQSPEC rectangle; `ragged` keeps one write cursor per row.
LAYOUTS: dict[str, type[Layout]] = {"padded": PaddedLayout, "ragged": RaggedLayout}


def make_layout(kind: str, model, max_rows: int, capacity: int) -> Layout:
    return LAYOUTS[kind](model, max_rows, capacity)
