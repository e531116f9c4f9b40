"""Layouts map rows (sequences in flight) onto one model's KV buffer: positions, masks, write slots."""

from .base import Layout
from .padded import PaddedLayout
from .ragged import RaggedLayout

__all__ = ["LAYOUTS", "METHOD_LAYOUT", "Layout", "PaddedLayout", "RaggedLayout", "make_layout"]

# `padded` is the paper's EQSPEC rectangle; `ragged` keeps one write cursor per row.
LAYOUTS: dict[str, type[Layout]] = {"padded": PaddedLayout, "ragged": RaggedLayout}
# Which layout each decoding method runs on.
METHOD_LAYOUT: dict[str, str] = {
    "ar": "ragged",
    "ragged": "ragged",
    "eqspec": "padded",
    "exspec": "padded",
    # Deliberately wrong methods. Their two broken layouts live in batchspec.forensics.broken, which
    # adds them to LAYOUTS when imported (batchspec.llm imports it), so no wrong code sits here.
    "naive-kv": "naive-kv",
    "naive-positions": "naive-positions",
    "naive-bonus": "ragged",
}


def make_layout(kind: str, model, max_rows: int, capacity: int) -> Layout:
    return LAYOUTS[kind](model, max_rows, capacity)
