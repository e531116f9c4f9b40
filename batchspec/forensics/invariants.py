"""Per-round invariant checks for a layout (`--check-invariants`).

Structural checks come from the layout itself (I1 for the padded rectangle, cursor bounds for the
ragged one). Checked here, independently of how the layout computed them:
- I2 position contiguity: in the last forward, each query's position equals the number of slots it
  could see minus one (so the first real token has position 0 and pads never count). These are the
  layout's real positions, before the clamp that feeds discarded drafts past the context the last
  position: a clamped value would differ from the slot count without being wrong;
- each row's committed length agrees with the engine's own count of that sequence's tokens;
- for a sample of rows, the cached K/V of the committed prefix equal a fresh batch-1 forward of
  that prefix on transformers' own DynamicCache, within a dtype-dependent tolerance;
- for models with recurrent state (the stateful layout), the committed recurrent and convolution
  states of a sampled row equal those a fresh forward over its committed prefix leaves in the model's
  own cache (and the K/V of its attention layers are checked as above).
"""

from __future__ import annotations

import torch

from ..kv import prefix_kv, prefix_state
from ..layouts import Layout, LayoutView
from ..layouts.stateful import StatefulLayout


class InvariantError(AssertionError):
    """A layout invariant broke: names the model, row, round and invariant."""


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def check_layout(
    layout: Layout,
    name: str,
    round_index: int,
    expected_lengths: list[int] | None,
    prefixes: list[list[int]],
    sample_rows: list[int],
    prompt_lengths: list[int] | None = None,
) -> None:
    """Raise InvariantError on the first broken invariant.

    expected_lengths: what each row's committed length must be (None when the layout's commit is
    lazy, as for drafters); prefixes[b]: token ids whose K/V row b must hold (a prefix of the
    committed tokens), checked for `sample_rows` only (it costs a forward per row); the fresh forward
    computes the first prompt_lengths[b] of them as prompt tokens (`roles.prompt_pass`).
    """

    def fail(row: int | None, what: str) -> None:
        where = f"row {row}" if row is not None else "layout"
        raise InvariantError(f"{name}: {where}, round {round_index}: {what}")

    for problem in layout.violations():
        fail(None, problem)
    if expected_lengths is not None:
        actual = layout.lengths.tolist()
        for row, (got, want) in enumerate(zip(actual, expected_lengths)):
            if got != want:
                fail(row, f"committed length {got} != sequence's {want}")
    if layout.last_positions is not None and layout.last_visible is not None:
        seen = layout.last_visible.sum(dim=-1) - 1
        bad = (layout.last_positions != seen).nonzero()
        if bad.numel():
            row, query = bad[0].tolist()
            fail(row, f"I2 position contiguity: query {query} has position "
                 f"{int(layout.last_positions[row, query])} but sees {int(seen[row, query]) + 1} slots")
    for row in sample_rows:
        start, count = layout.row_slots(row)
        prefix = prefixes[row]
        prompt_length = prompt_lengths[row] if prompt_lengths is not None else 0
        if len(prefix) > count:
            fail(row, f"asked to check {len(prefix)} tokens but only {count} are committed")
        if isinstance(layout, StatefulLayout):
            problem = _stateful_row_problem(layout, row, prefix, prompt_length)
            if problem:
                fail(row, problem)
            continue
        if not prefix:
            continue
        cached = layout.store.row_kv(row, start, len(prefix)).float()
        fresh = prefix_kv(layout.model, prefix, prompt_length).float()
        scale = 1.0 + fresh.abs().max().item()
        err = (cached - fresh).abs().max().item()
        if err > _tolerance(layout.store.data.dtype) * scale:
            fail(row, f"cached K/V differ from a fresh forward of the prefix (max abs error {err:.3g})")


def _differs(cached: torch.Tensor, fresh: torch.Tensor) -> float | None:
    """The max abs error when `cached` is not `fresh` within tolerance, else None."""
    tolerance = _tolerance(cached.dtype)
    cached, fresh = cached.float(), fresh.to(cached.device).float()
    err = (cached - fresh).abs().max().item() if cached.shape == fresh.shape else float("inf")
    return err if err > tolerance * (1.0 + fresh.abs().max().item()) else None


def _stateful_row_problem(layout: StatefulLayout, row: int, prefix: list[int], prompt_length: int) -> str | None:
    """What is wrong with one row of a stateful layout, if anything: its committed states against a
    fresh forward over the committed tokens (a prefix of `prefix`: a drafter commits lazily), and its
    attention K/V against a fresh forward over `prefix`."""
    count, states = layout.committed_state(row)
    if count > len(prefix):
        return f"state of {count} tokens committed but only {len(prefix)} are known to be right"
    kv, fresh = prefix_state(layout.model, prefix, prompt_length) if prefix else (None, {})
    if count == 0:
        fresh = {key: torch.zeros_like(value) for key, value in states.items()}
    elif count < len(prefix):
        fresh = prefix_state(layout.model, prefix[:count], prompt_length)[1]
    for key, want in fresh.items():
        if key not in states:
            return f"no committed {key[1]} state for layer {key[0]}"
        err = _differs(states[key], want)
        if err is not None:
            return (f"committed {key[1]} state of layer {key[0]} differs from a fresh forward of the committed "
                    f"prefix of {count} tokens (max abs error {err:.3g})")
    if kv is not None:
        err = _differs(layout.store.row_kv(row, 0, len(prefix)), kv)
        if err is not None:
            return f"cached K/V differ from a fresh forward of the prefix (max abs error {err:.3g})"
    return None


def check_views(views: list[LayoutView], round_index: int) -> None:
    """The engine's per-round hook (injected by `batchspec.build.build_engine`): check every view."""
    for view in views:
        check_layout(view.layout, view.name, round_index, view.expected_lengths, view.prefixes, view.sample_rows,
                     view.prompt_lengths)
