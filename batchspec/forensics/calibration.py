"""The fp-tie margin: how far the target's logits can move when only the batch shape changes.

Two correct computations of the same prefix (batch 1 vs a left-padded batch, or one of our layouts
in the verify shape) differ by floating-point noise; when the two best tokens' logits are closer
than that noise, either may win. The margin is measured on the audited model in its dtype, on
prefixes as the audit meets them (a prompt plus half of its oracle continuation), each token in its
role: a model with a prompt path (`--prefill-kernel int8`) computes the prompt as prompt tokens and
the continuation as generated ones, as plain decoding does (`roles.prompt_pass`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kernels import has_prompt_path
from ..kv import forward_left_padded, forward_plain, is_stateful, new_dynamic_cache
from ..layouts import Layout
from ..layouts.base import left_padded
from ..methods import layout_for
from ..roles import prompt_pass

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


# A calibration prefix: the prompt's ids and the continuation's (plain decoding's output) after it.
Prefix = tuple[list[int], list[int]]


def calibration_prefixes(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                         common: bool = False) -> list[Prefix]:
    """Prefixes as the audit meets them: each prompt and the first half of its oracle output; with
    `common`, the same number of output tokens for every prompt (the shortest half that is not empty;
    prompts whose half is shorter are left out), so that a layout can feed them to every row as
    generated tokens in one forward."""
    halves = [len(o) // 2 for o in outputs]
    if not common:
        return [(list(p), list(o[:h])) for p, o, h in zip(prompts, outputs, halves)]
    size = min((h for h in halves if h > 0), default=0)
    return [(list(p), list(o[:size])) for p, o, h in zip(prompts, outputs, halves) if h >= size]


@torch.inference_mode()
def prefix_logits(model: torch.nn.Module, prefix: list[int], prompt_length: int = 0) -> torch.Tensor:
    """Last-position logits [vocab] of one prefix, alone, on transformers' own cache and masks; its
    first `prompt_length` tokens are its prompt (`roles.prompt_pass`)."""
    device = next(model.parameters()).device
    with prompt_pass(prompt_length):
        return forward_plain(model, torch.tensor([prefix], device=device), new_dynamic_cache(model))[0]


def _verify_shaped_logits(model: torch.nn.Module, layout_class: type[Layout], prefixes: list[Prefix],
                          width: int) -> torch.Tensor:
    """Last-position logits [b, vocab] when one of our layouts prefills each prompt, feeds its
    continuation but the last `width` tokens in one forward (continuations of one length), and then
    the last `width` at once, as a verification round does."""
    layout = layout_class(model, len(prefixes), max(len(p) + len(c) for p, c in prefixes))
    layout.prefill([p for p, _ in prefixes])
    head = torch.tensor([c[:-width] for _, c in prefixes], dtype=torch.long, device=layout.device)
    if head.shape[1]:
        layout.forward(head)
        layout.commit(layout.lengths)  # every fed token stays
    tokens = torch.tensor([c[-width:] for _, c in prefixes], dtype=torch.long, device=layout.device)
    return layout.forward(tokens)[:, -1]


def calibrate_margin(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                     outputs: Sequence[Sequence[int]]) -> Calibration:
    """Measure batch-shape logit noise on prefixes of `prompts` and their plain-decoding `outputs`
    and derive the fp-tie margin from it.

    Without a prompt path a token's role changes nothing, so the layouts prefill all but the last
    `width` tokens of each prefix and transformers' left-padded batch is measured too. With one, the
    layouts prefill the prompts and feed the continuations as generated tokens, and the left-padded
    batch is left out: roles go by position, which left padding moves, and no other program decodes
    on this path."""
    dtype = next(model.parameters()).dtype
    roles = has_prompt_path(model)
    prefixes = calibration_prefixes(prompts, outputs, common=roles)
    if not prefixes:
        return Calibration(dtype=dtype_name(model), margin=0.0, source="calibrated")
    single = torch.stack([prefix_logits(model, p + c, len(p)) for p, c in prefixes])
    noise: dict[str, float] = {}
    if is_stateful(model):  # left padding would enter the recurrent state: only our stateful layout runs it
        layouts: dict[str, type[Layout]] = {"stateful": layout_for(model)}
    else:
        if not roles:
            device = next(model.parameters()).device
            padded = forward_left_padded(model, *left_padded([p + c for p, c in prefixes], device))
            noise["hf-left-padded"] = float((padded - single).abs().max())
        layouts = {"ragged": layout_for(model, "ragged"), "padded": layout_for(model, "eqspec")}
    if roles:
        width = min(VERIFY_WIDTH, len(prefixes[0][1]))
    else:  # the whole prefix may be re-split: its last `width` tokens fed as the verify
        width = min(VERIFY_WIDTH, min(len(p) + len(c) for p, c in prefixes) - 1)
        prefixes = [((p + c)[:-width], (p + c)[-width:]) for p, c in prefixes] if width >= 1 else prefixes
    if width >= 1:
        for kind, layout_class in layouts.items():
            batched = _verify_shaped_logits(model, layout_class, prefixes, width)
            noise[f"{kind}-verify"] = float((batched - single).abs().max())
    if not noise:  # one-token prefixes or continuations only: nothing batched to measure
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
