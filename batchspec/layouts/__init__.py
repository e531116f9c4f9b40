"""Layouts map rows (sequences in flight) onto one model's KV buffer: positions, masks, write slots."""

from .base import Layout
from .padded import PaddedLayout
from .ragged import RaggedLayout

__all__ = ["Layout", "PaddedLayout", "RaggedLayout", "make_layout"]


def make_layout(kind: str, model, max_rows: int, capacity: int) -> Layout:
    """`padded` is the paper's EQSPEC rectangle; `ragged` keeps one write cursor per row."""
    return {"padded": PaddedLayout, "ragged": RaggedLayout}[kind](model, max_rows, capacity)
