"""A small language model as drafter, with its own KV cache kept in the same layout as the target's.

Never re-prefills: each round it rolls its cache back to all but the last two tokens of each
sequence, then feeds those two. That one uniform step absorbs both cases left by a round it drafted
in (the bonus token alone is new, or the last accepted draft it never fed plus the bonus) without any
per-row branching; recomputing one token's K/V costs next to nothing.

Rounds without drafts (adaptive speculation turned them down) do not involve it at all, so the
sequences run ahead of its cache. It first `skip`s such a round: its cursors fall back to committed
tokens only (drafts it fed are not the sequence's). At the next `draft`, every row that lags by more
than the usual two tokens is caught up before the usual two-token step: a short lag in one forward
shared by all rows (ragged per row: right-padded to the longest catch-up, the padding slots lying
beyond each row's cursor afterwards), a long one (over SHARED_CATCH_UP tokens) in a forward of that
row alone at its own length, as a prefill would. So a row never re-prefills, whatever the number of
rounds without drafts.

Lazy (adaptive speculation on per-row cursors), it does not prefill prompts at admission at all: a new
row holds nothing, and its prompt is its lag, caught up the first time the policy finds drafting for it
worth that cost (`backlog` tells the policy what each row would cost). A row the policy leaves out of a
round (`Steering.drafting`) is not caught up; it is fed along with the others (the forward is
rectangular) and its cursor is set back afterwards, so its cache keeps only what is valid.

Under a per-step token budget (chunked prefill) the policy may start a catch-up that what is left of
the step's budget cannot hold (`Steering.pieces`): the row is fed that many tokens of its lag, alone,
and does not draft this round. Its cursor then stands at what it validly holds, so the next step's lag (`backlog`) is
what remains, and it drafts once a step can finish its catch-up.

A quantized drafter also holds an int8 prompt path (`models.draft_prefill_kernel`), which computes a
forward of one row faster than its weights' kernel from ~17 tokens on, twice as fast from ~64
(docs/quantization.md, "Its prompt path"), and slower below. Its prefills take it (as the
target's do, `roles.prompt_pass`), and so does a forward of one row alone that continues the slots the
row computed that way (`prompt_slots`): a deferred prefill, and its pieces. Every other forward (a
shared catch-up, a drafting step, a catch-up after drafting began) takes the weights' kernel. So each
row's K/V is its leading `prompt_slots` tokens by the prompt path and the rest by the weights', which
is what `views` asks the invariant checker to recompute. Drafts are proposals: how the drafter computed
them changes acceptance, never the output.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from ..kernels import has_prompt_path
from ..layouts import Layout, LayoutView, RaggedLayout
from ..layouts.base import FILLER_TOKEN
from ..roles import prompt_pass
from ..sequence import Sequence
from .base import SHARED_CATCH_UP, Backlog, CatchUp, Draft, Drafter, Picker, Steering, empty_draft, pick_argmax


class ModelDrafter(Drafter):
    """Rows live in `pool` between rounds when one is given (EXSPEC), else in `layout` itself;
    rounds always run on `layout`. `lazy`: prompts are prefilled when first drafted for, not at
    admission (per-row cursors only)."""

    asks_first = True

    def __init__(self, layout: Layout, pool: Layout | None = None, lazy: bool = False) -> None:
        self.layout = layout
        self.pool = pool
        self.rowwise = pool is None and isinstance(layout, RaggedLayout)  # can feed one row alone
        if lazy and not self.rowwise:
            raise ValueError("a lazy drafter prefill needs per-row cursors (the ragged layout, unpooled)")
        self.lazy = lazy
        self.caught_up: list[CatchUp] = []  # the catch-up forwards of the last `draft`
        # Per row of the home layout: its leading slots whose K/V the prompt path computed (see above).
        self.prompt_slots: list[int] = []
        self._group: list[int] = []  # pooled: the pool rows the round's rows were loaded from (`load`)
        self.prompt_path = has_prompt_path(layout.model)
        self.totals = {"draft_catch_up_tokens": 0.0, "draft_catch_up_time": 0.0}

    @property
    def _home(self) -> Layout:
        return self.pool if self.pool is not None else self.layout

    def add(self, seqs: list[Sequence]) -> None:
        if self.lazy:
            self.layout.add_empty(len(seqs))
            self.prompt_slots += [0] * len(seqs)
        else:
            self._home.prefill([s.prompt_ids for s in seqs])
            self.prompt_slots += [len(s.prompt_ids) for s in seqs]

    def backlog(self, seqs: list[Sequence]) -> Backlog:
        """Tokens each row would be fed before it can be drafted for (its prompt, if lazy and never
        drafted for), and whether that runs on the prompt path: fed alone from where the slots its
        prompt path computed end (a deferred prefill). Pooled or padded, rows cannot be left out of a
        catch-up: none reported."""
        if not self.rowwise:
            return Backlog([0] * len(seqs), [False] * len(seqs))
        held = self.layout.lengths.tolist()  # one host copy a round: the engine asks every round
        # `_span`'s difference, in Python: a row holds at most all but its last two tokens
        lags = [max(s.length - 2 - have, 0) for s, have in zip(seqs, held)]
        fast = [self.prompt_path and have == slots for have, slots in zip(held, self.prompt_slots)]
        return Backlog(lags, fast)

    def catch_ups(self) -> list[CatchUp]:
        return self.caught_up

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        return self.draft(seqs, k, pick)

    def propose_steered(self, seqs: list[Sequence], k: int, pick: Picker, steer: Steering) -> Draft:
        return self.draft(seqs, k, pick, steer)

    def draft(
        self,
        seqs: list[Sequence],
        k: int,
        pick: Picker = pick_argmax,
        steer: Steering | None = None,
        forced: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Draft:
        """Up to k drafts per row (fewer if `steer` stops it). `forced` = (tokens [b, k], lengths [b])
        replaces row b's first lengths[b] picks by those tokens, which are then what it feeds (a hybrid
        drafter's n-gram proposals): its cache always holds exactly the drafts it proposed."""
        self.caught_up = []
        go = steer is None or steer.proceed(0)
        if steer is not None and self.rowwise:
            self._feed_pieces(seqs, steer.pieces())
        if not go:
            self.layout.commit(self._committed(seqs))
            return empty_draft(len(seqs), self.layout.device)
        joined = steer.drafting() if steer is not None and self.rowwise else None
        have, feed = self._catch_up(seqs, joined)
        self._overwritten(self.layout.lengths)  # the steps feed every row from its cursor
        tokens, logits, forced_slots = [], [], []
        for step in range(k):
            step_logits = self.layout.forward(feed, last_only=True)[:, -1]
            token = pick(step_logits, step)
            use = None
            if forced is not None:
                use = step < forced[1]
                token = torch.where(use, forced[0][:, step], token)
                forced_slots.append(use)
            tokens.append(token)
            logits.append(step_logits)
            if steer is not None:
                steer.observed(step, step_logits, token, use)
                if step + 1 < k and not steer.proceed(step + 1):
                    break
            feed = token[:, None]
        lengths = None
        if joined is not None and not bool(joined.all()):
            self.layout.commit(torch.where(joined, self.layout.lengths, have))  # left-out rows keep what is valid
            lengths = torch.where(joined, len(tokens), 0)
        return Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), lengths,
                     forced=torch.stack(forced_slots, dim=1) if forced is not None else None)

    def _committed(self, seqs: list[Sequence]) -> torch.Tensor:
        """How many leading tokens of each row its cache surely holds at the start of a round: what it
        fed, but at most all but the last token of the sequence. Right after a round it drafted in, the
        drafts it fed beyond the accepted ones sit at or after that point (the target's token at the
        first rejection differs from the rejected draft); after a `skip`, it holds committed tokens only."""
        real = torch.tensor([s.length for s in seqs], dtype=torch.long, device=self.layout.device)
        return torch.minimum(self.layout.lengths, real - 1)

    def _span(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """([b] what each row's cache validly holds now, [b] what it must hold right before a round's
        two-token step: all but the last two tokens); a row lags by the difference."""
        target = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=self.layout.device)
        return torch.minimum(self._committed(seqs), target), target

    def _catch_up(self, seqs: list[Sequence], joined: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll back to all but the last two tokens of each row (of `joined` rows; None: all), first
        feeding what rows lagging further behind have not seen: long lags row by row, short ones in one
        shared forward. Returns what each row's cache validly held before [b] and the two tokens [b, 2]
        to feed next."""
        device = self.layout.device
        have, target = self._span(seqs)
        joined = torch.ones_like(have, dtype=torch.bool) if joined is None else joined.to(device)
        lag = torch.where(joined, target - have, 0)
        self.layout.commit(have)
        shared = lag > 0
        if self.rowwise:
            alone = lag > SHARED_CATCH_UP
            short = int(lag[~alone].max()) if bool((~alone).any()) else 0
            if int((have + torch.where(alone, lag, 0)).max()) + short > self.layout.store.capacity:
                alone = lag > 0  # the shared rectangle would run past some row's slots: no sharing
            for b in alone.nonzero().flatten().tolist():
                self._feed_alone(seqs[b], b, int(have[b]), int(lag[b]), True)
            shared &= ~alone
        if bool(shared.any()):
            self._overwritten(self.layout.lengths)  # a rectangle: every row is fed from its cursor
            width = int(lag[shared].max())
            rows = []
            for s, b, n, fed in zip(seqs, have.tolist(), lag.tolist(), shared.tolist()):
                row = self._lagging(s, b, n) if fed else []
                rows.append(row + [FILLER_TOKEN] * (width - len(row)))
            fed_rows = shared.nonzero().flatten().tolist()
            self._timed(fed_rows, [int(lag[b]) for b in fed_rows], True, True,
                        self.layout.forward, torch.tensor(rows, dtype=torch.long, device=device), True)
        self.layout.commit(torch.where(joined, target, have))
        return have, torch.tensor([s.tail(2) for s in seqs], dtype=torch.long, device=device)

    def _feed_pieces(self, seqs: list[Sequence], pieces: torch.Tensor) -> None:
        """Feed row b the next pieces[b] tokens of its lag, alone and committed: a piece of a catch-up
        that later steps finish (the row does not draft this round)."""
        if not bool(pieces.any()):
            return
        have, target = self._span(seqs)
        self.layout.commit(self._committed(seqs))  # a lagging row's cursor: what it validly holds
        for b in pieces.nonzero().flatten().tolist():
            lag = int(target[b] - have[b])
            n = min(int(pieces[b]), lag)
            self._feed_alone(seqs[b], b, int(have[b]), n, n == lag)

    def _feed_alone(self, seq: Sequence, b: int, have: int, n: int, complete: bool) -> None:
        """Feed row b (holding `have` tokens) its next n tokens in a forward of its own: by the prompt
        path where that continues the slots it computed (`prompt_slots`), else by the weights'."""
        fast = self.prompt_slots[b] == have
        with prompt_pass() if fast else nullcontext():
            self._timed([b], [n], False, complete, self.layout.feed_row, b, self._lagging(seq, have, n))
        self.prompt_slots[b] = have + n if fast else min(self.prompt_slots[b], have)

    def _overwritten(self, starts: torch.Tensor) -> None:
        """The round's rows were fed by the weights' kernel from slots `starts` [b] on: what their
        prompt path computed ends there at the latest."""
        rows = self._group if self.pool is not None else range(len(self.prompt_slots))
        for row, start in zip(rows, starts.tolist()):
            self.prompt_slots[row] = min(self.prompt_slots[row], start)

    @staticmethod
    def _lagging(seq: Sequence, have: int, n: int) -> list[int]:
        """The n tokens of `seq` after its first `have` (tail() copies only the span from there on)."""
        return seq.tail(seq.length - have)[:n]

    def _timed(self, rows: list[int], tokens: list[int], shared: bool, complete: bool,
                feed: Callable[..., object], *args: object) -> None:
        """Run one catch-up forward, `feed(*args)`, and note it (`catch_ups`, the drafter's counters)."""
        start = self.layout.clock()
        feed(*args)
        seconds = self.layout.clock() - start
        self.caught_up.append(CatchUp(rows, tokens, shared, complete, seconds))
        self.totals["draft_catch_up_tokens"] += sum(tokens)
        self.totals["draft_catch_up_time"] += seconds

    def skip(self, seqs: list[Sequence]) -> None:
        self.caught_up = []
        self.layout.commit(self._committed(seqs))

    def drop(self, keep: list[bool]) -> list[int]:
        order = self._home.drop(keep)
        self.prompt_slots = [self.prompt_slots[i] for i in order]
        return order

    def load(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """What the pool holds of each row, at most all but its last two tokens: `propose` feeds those
        two first (and anything the row lags by before them)."""
        if self.pool is not None:
            wanted = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=self.layout.device)
            self.layout.load_rows(self.pool, rows, torch.minimum(self.pool.lengths[rows], wanted))
            self._group = rows.tolist()

    def save(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """Only K/V of accepted tokens is valid, and the drafter may have fed rejected drafts beyond
        them: keep at most all but the last two tokens (what the next `load` takes anyway)."""
        if self.pool is not None:
            valid = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=self.layout.device)
            self.layout.save_rows(self.pool, rows, self.layout.lengths.clamp(max=valid))

    def begin_stage(self, prompt: list[int], staged: int) -> None:
        """The staging row is brought to the target's `staged` tokens: from this model's own prefix
        cache where it holds them, fed otherwise (lazy rows hold nothing until drafted for)."""
        if not self.lazy:
            self._home.begin_stage(prompt, reach=staged)

    def stage(self, tokens: list[int]) -> None:
        if not self.lazy:
            self._home.stage(tokens)

    def unstage(self) -> None:
        if self.lazy:
            self.layout.add_empty(1)
            self.prompt_slots.append(0)
        else:
            self.prompt_slots.append(self._home.staged)  # every staged chunk is a prompt pass
            self._home.unstage()

    def discard_staged(self) -> None:
        if not self.lazy:
            self._home.discard_staged()

    def counters(self) -> dict[str, float]:
        return self._home.counters() | self.totals

    def views(self, seqs: list[Sequence], sample_rows: list[int]) -> list[LayoutView]:
        """Its cached K/V must hold each row's tokens up to what it last fed (at most all but the
        last two, which the next round feeds again); its commits are lazy, so lengths are not pinned.
        Pooled, the rectangle it drafted in is checked for structure and positions too."""
        home = self._home
        valid = [min(int(n), s.length - 2) for n, s in zip(home.lengths.tolist(), seqs)]
        prefixes = [s.tokens[:v] for s, v in zip(seqs, valid)]
        if self.pool is None:
            return [LayoutView("drafter", home, None, prefixes, sample_rows, self.prompt_slots)]
        return [LayoutView("drafter pool", home, None, prefixes, sample_rows, self.prompt_slots),
                LayoutView("drafter group", self.layout, None, [], [])]
