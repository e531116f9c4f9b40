"""Layouts map rows (sequences in flight) onto one model's KV buffer: positions, masks, write slots.

Which method runs on which layout is the method registry's business (`batchspec.methods`).
"""

from .base import Layout, LayoutView
from .padded import PaddedLayout
from .ragged import RaggedLayout

__all__ = ["Layout", "LayoutView", "PaddedLayout", "RaggedLayout"]
