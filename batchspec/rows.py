"""The rows in flight, for the target and its drafter together.

Every move on a row (admit, stage, drop, load, commit) is made on both models here, in the same row
order, so the drafter's mirror can never drift from the target's rows. `Rows` runs each round on the
home layout itself; `PooledRows` (EXSPEC) keeps a ragged pool at home and runs each round on a group
loaded into a rectangle, then saves it back.
"""

from __future__ import annotations

import torch

from .drafters import Drafter
from .kernels import has_prompt_path
from .layouts import Layout, LayoutView
from .sequence import Sequence


class Rows:
    """The target's rows in `home` (where they live between rounds and where rounds run) and the
    drafter that mirrors them."""

    def __init__(self, home: Layout, drafter: Drafter) -> None:
        self.home = home
        self.layout = home  # where a round runs
        self.drafter = drafter
        # With a prompt path (`kernels.PREFILL_INT8`) a generated token's K/V is not what a prefill of
        # it would compute, so a finished row leaves only its prompt in the prefix cache.
        self.cache_answers = not has_prompt_path(home.model)

    @property
    def max_rows(self) -> int:
        return self.home.store.max_rows

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def staged(self) -> int:
        """Prompt tokens of the prompt being prefilled in chunks that are already in."""
        return self.home.staged

    def clock(self) -> float:
        return self.home.clock()

    # ---- admission ----------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Append rows for whole prompts; the target's last prompt logits [b, vocab]."""
        logits = self.home.prefill([s.prompt_ids for s in seqs])
        self.drafter.add(seqs)
        return logits

    def begin_stage(self, prompt: list[int]) -> int:
        """Start prefilling `prompt` in chunks: the tokens already in (its prefix from the prefix
        cache, if any; the drafter's staging row is brought to the same count)."""
        staged = self.home.begin_stage(prompt)
        self.drafter.begin_stage(prompt, staged)
        return staged

    def stage(self, chunk: list[int]) -> torch.Tensor:
        """The next chunk of the prompt being admitted; the target's logits at its last token [vocab]."""
        logits = self.home.stage(chunk)
        self.drafter.stage(chunk)
        return logits

    def unstage(self) -> None:
        """The staged prompt is complete and becomes the last row."""
        self.home.unstage()
        self.drafter.unstage()

    def discard_staged(self) -> None:
        self.home.discard_staged()
        self.drafter.discard_staged()

    def remember(self, rows: list[int], seqs: list[Sequence]) -> None:
        """Rows `rows` (holding `seqs`) are done: the home layout keeps the K/V of their committed
        tokens in its prefix cache, if it has one, so a later prompt that continues one (the next
        turn of a chat) finds it. The drafter's rows may lag, so only the target's are kept."""
        for row, seq in zip(rows, seqs):
            self.home.remember(row, seq.tokens[: seq.length - 1] if self.cache_answers else seq.prompt_ids)

    def drop(self, keep: list[bool]) -> list[int]:
        """Remove rows where `keep` is False; the surviving rows' old indices, in their new order."""
        order = self.home.drop(keep)
        self.drafter.drop(keep)
        return order

    # ---- one round ----------------------------------------------------------------------------
    def load(self, group: list[int], seqs: list[Sequence]) -> None:
        """Make rows `group` (holding `seqs`) the rows the next forward runs: all of them, here."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, n] -> the target's logits [b, n, vocab] after each."""
        return self.layout.forward(tokens)

    def commit(self, group: list[int], seqs: list[Sequence]) -> None:
        """Keep the target K/V of every token of `seqs` but the last (it is fed first next round)."""
        self.layout.commit(_kept(seqs, self.device))

    # ---- reporting ----------------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        """The target's and the drafter's running totals, added up."""
        totals = dict(self.home.counters())
        for name, value in self.drafter.counters().items():
            totals[name] = totals.get(name, 0) + value
        return totals

    def views(self, running: list[Sequence], sample: list[int]) -> list[LayoutView]:
        """What the invariant checker verifies after a round: the target's rows at home (committed
        lengths and, for rows `sample`, cached K/V), the rectangle the round ran on when it is not
        home (its structure and positions), and the drafter's."""
        views = [LayoutView("target", self.home, [s.length - 1 for s in running],
                            [s.tokens[:-1] for s in running], sample, [len(s.prompt_ids) for s in running])]
        if self.layout is not self.home:
            views.append(LayoutView("target group", self.layout, None, [], []))
        return views + self.drafter.views(running, sample)


class PooledRows(Rows):
    """Rows pooled in a ragged `home`; each round runs the scheduler's group in `layout`."""

    def __init__(self, home: Layout, layout: Layout, drafter: Drafter) -> None:
        super().__init__(home, drafter)
        self.layout = layout

    def load(self, group: list[int], seqs: list[Sequence]) -> None:
        rows = torch.tensor(group, dtype=torch.long, device=self.device)
        self.layout.load_rows(self.home, rows, _kept(seqs, self.device))
        self.drafter.load(rows, seqs)

    def commit(self, group: list[int], seqs: list[Sequence]) -> None:
        rows = torch.tensor(group, dtype=torch.long, device=self.device)
        self.layout.save_rows(self.home, rows, _kept(seqs, self.device))
        self.drafter.save(rows, seqs)


def _kept(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """K/V lengths [b] a row keeps between rounds: all its tokens but the last."""
    return torch.tensor([s.length - 1 for s in seqs], dtype=torch.long, device=device)
