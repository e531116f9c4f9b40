"""The fp-tie margin: how far the target's logits can move when only the batch shape changes.

Two correct computations of the same prefix (batch 1 vs a left-padded batch, or one of our layouts
in the verify shape) differ by floating-point noise; when the two best tokens' logits are closer
than that noise, either may win. The margin is measured on the audited model in its dtype, on
prefixes as the audit meets them (a prompt plus half of its oracle continuation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kv import forward_left_padded, forward_plain, is_stateful, new_dynamic_cache
from ..layouts import Layout
from ..layouts.base import left_padded
from ..methods import layout_for

# A flip between two computations needs gap < |noise(oracle token)| + |noise(audited token)|, at most
# twice the largest noise measured; the second factor of 2 covers batch shapes calibration missed.
MARGIN_FACTOR = 4.0
# Rows of the verify-shaped calibration forward: K = 5 drafts plus the pending token, as in a round.
VERIFY_WIDTH = 6


@dataclass
class Calibration:
    """The fp-tie margin and the measurements it came from (logit units)."""

    dtype: str
    margin: float
    source: str  # "calibrated" or "given"
    prefixes: int = 0
    noise: dict[str, float] = field(default_factory=dict)  # largest |logit diff| vs batch-1, per batch shape
    max_noise: float | None = None
    floor: float | None = None  # about one ulp of the largest logit in this dtype


def dtype_name(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def calibration_prefixes(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Prefixes as the audit meets them: each prompt plus the first half of its oracle output."""
    return [list(p) + list(o[: len(o) // 2]) for p, o in zip(prompts, outputs)]


@torch.inference_mode()
def prefix_logits(model: torch.nn.Module, prefix: list[int]) -> torch.Tensor:
    """Last-position logits [vocab] of one prefix, alone, on transformers' own cache and masks."""
    device = next(model.parameters()).device
    return forward_plain(model, torch.tensor([prefix], device=device), new_dynamic_cache(model))[0]


def _verify_shaped_logits(
    model: torch.nn.Module, layout_class: type[Layout], prefixes: list[list[int]], width: int
) -> torch.Tensor:
    """Last-position logits [b, vocab] when one of our layouts prefills all but `width` tokens of
    each prefix and then feeds the last `width` at once, as a verification round does."""
    layout = layout_class(model, len(prefixes), max(len(p) for p in prefixes))
    layout.prefill([p[:-width] for p in prefixes])
    tokens = torch.tensor([p[-width:] for p in prefixes], dtype=torch.long, device=layout.device)
    return layout.forward(tokens)[:, -1]


def calibrate_margin(model: torch.nn.Module, prefixes: list[list[int]]) -> Calibration:
    """Measure batch-shape logit noise on `prefixes` and derive the fp-tie margin from it."""
    dtype = next(model.parameters()).dtype
    if not prefixes:
        return Calibration(dtype=dtype_name(model), margin=0.0, source="calibrated")
    single = torch.stack([prefix_logits(model, p) for p in prefixes])
    noise: dict[str, float] = {}
    if is_stateful(model):  # left padding would enter the recurrent state: only our stateful layout runs it
        layouts: dict[str, type[Layout]] = {"stateful": layout_for(model)}
    else:
        device = next(model.parameters()).device
        padded = forward_left_padded(model, *left_padded(prefixes, device))
        noise["hf-left-padded"] = float((padded - single).abs().max())
        layouts = {"ragged": layout_for(model, "ragged"), "padded": layout_for(model, "eqspec")}
    width = min(VERIFY_WIDTH, min(len(p) for p in prefixes) - 1)
    if width >= 1:
        for kind, layout_class in layouts.items():
            batched = _verify_shaped_logits(model, layout_class, prefixes, width)
            noise[f"{kind}-verify"] = float((batched - single).abs().max())
    if not noise:  # one-token prefixes only: nothing batched to measure
        return Calibration(dtype=dtype_name(model), margin=0.0, source="calibrated", prefixes=len(prefixes))
    max_noise = max(noise.values())
    floor = torch.finfo(dtype).eps * float(single.abs().max())
    return Calibration(
        dtype=dtype_name(model),
        margin=max(MARGIN_FACTOR * max_noise, floor),
        source="calibrated",
        prefixes=len(prefixes),
        noise=noise,
        max_noise=max_noise,
        floor=floor,
    )
