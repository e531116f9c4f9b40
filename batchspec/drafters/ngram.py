"""Prompt-lookup drafting: propose what followed an earlier occurrence of the context's suffix.

vLLM's `ngram` method: per row, find the longest n-gram (min_n <= n <= max_n) ending the context
that occurred earlier in the prompt or the output, take its first occurrence, and propose the tokens
that followed it there (as many as the context has, up to k). Rows without a match propose nothing.

A proposal's confidence is the length n of the suffix that matched, as n / (n + 2): replayed over
plain outputs of the bundled Qwen target on 36 SpecBench prompts (`scripts/lookup_replay.py`), the
first draft after a 1-token match was accepted 19% of the time, after a 2-token match 43%, after
7-8 tokens 80%, so adaptive speculation can verify long matches and decline short ones where
verifying costs (it learns the real rates per confidence bin online; this only sorts proposals
into bins that start near them). In a hybrid draft the model drafter's own probability of a
forced token is its confidence instead, wherever the model ran.

No second model: each sequence keeps an index {n-gram: position after its first occurrence},
updated with the tokens committed since the last round only, so a lookup costs max_n - min_n + 1
dictionary probes and no scan over the context. The index covers n-grams ending before the last
token, so the suffix never finds itself.

`HybridDrafter` puts the lookup in front of a model drafter: rows whose context matches propose the
n-gram continuation (and the model continues after it), the others the model's own drafts.
"""

from __future__ import annotations

import torch

from ..layouts import LayoutView
from ..layouts.base import FILLER_TOKEN
from ..sequence import Sequence
from .base import Backlog, CatchUp, Draft, Drafter, Picker, Steering, pick_argmax
from .model import ModelDrafter


def _window(seq: Sequence, start: int, stop: int) -> list[int]:
    """seq.tokens[start:stop] without materialising prompt + generated (0 <= start <= stop <= length)."""
    prompt = len(seq.prompt_ids)
    if stop <= prompt:
        return seq.prompt_ids[start:stop]
    if start >= prompt:
        return seq.generated[start - prompt : stop - prompt]
    return seq.prompt_ids[start:] + seq.generated[: stop - prompt]


class NgramIndex:
    """One sequence's n-grams of lengths min_n..max_n, each mapped to the position right after its
    first occurrence; covers n-grams ending before the sequence's last token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in

    def update(self, seq: Sequence) -> None:
        """Index the n-grams ending at the positions committed since the last update (all but the last)."""
        end = seq.length - 1
        if end <= self.indexed:
            return
        lo = max(0, self.indexed - self.max_n + 1)
        window = _window(seq, lo, end)
        for t in range(self.indexed, end):
            at = t - lo  # position t inside `window`
            for n in range(self.min_n, min(self.max_n, t + 1) + 1):
                self.first.setdefault(tuple(window[at - n + 1 : at + 1]), t + 1)
        self.indexed = end

    def lookup(self, seq: Sequence, k: int) -> tuple[int, list[int]]:
        """The length of the longest matching suffix (0: none) and up to k tokens that followed its
        first earlier occurrence."""
        self.update(seq)
        tail = seq.tail(min(self.max_n, seq.length))
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            start = self.first.get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return n, _window(seq, start, min(start + k, seq.length))
        return 0, []


def match_confidence(matched: torch.Tensor, k: int) -> torch.Tensor:
    """[b, k] confidence of every slot of a row whose proposal followed a matched[b]-token suffix."""
    n = matched.double()
    return (n / (n + 2)).unsqueeze(1).expand(-1, k).contiguous()


class NgramLookup:
    """The n-gram indexes of the sequences in flight, keyed by sequence identity (so no row order to
    mirror); indexes of finished sequences are dropped at the next lookup."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[int, tuple[Sequence, NgramIndex]] = {}

    def propose(self, seqs: list[Sequence], k: int, device: torch.device) -> Draft:
        """Each row's n-gram continuation, k wide (padded with filler; its length in `lengths`), with
        the matched suffix's length as its confidence."""
        self.indexes = {key: entry for key, entry in self.indexes.items() if not entry[0].finished}
        found = []
        for s in seqs:
            entry = self.indexes.get(id(s))
            if entry is None or entry[0] is not s:
                entry = self.indexes[id(s)] = (s, NgramIndex(self.min_n, self.max_n))
            found.append(entry[1].lookup(s, k))
        tokens = torch.tensor([row + [FILLER_TOKEN] * (k - len(row)) for _, row in found], dtype=torch.long,
                              device=device).view(len(seqs), k)
        lengths = torch.tensor([len(row) for _, row in found], dtype=torch.long, device=device)
        matched = torch.tensor([n for n, _ in found], dtype=torch.long, device=device)
        return Draft(tokens, None, lengths, confidence=match_confidence(matched, k))


class NgramDrafter(Drafter):
    """Prompt lookup alone: deterministic drafts (no logits; q is a point mass under rejection
    sampling), free to compute, so rows without a match simply draft nothing."""

    def __init__(self, min_n: int, max_n: int, device: torch.device | str = "cpu") -> None:
        self.lookup = NgramLookup(min_n, max_n)
        self.device = torch.device(device)

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        draft = self.lookup.propose(seqs, k, self.device)
        return draft.capped(draft.row_lengths())


class HybridDrafter(Drafter):
    """N-gram continuations where a row's context has a match, a model drafter's drafts elsewhere and
    after a continuation runs out. The model feeds the n-gram tokens as its own drafts, so its cache
    stays exactly what it proposed; when every row's continuation covers the whole round, or the
    steering finds a model step not worth its cost, the model does not run at all (it catches up at
    its next round, see `ModelDrafter`) and the continuations alone are proposed."""

    def __init__(self, lookup: NgramLookup, model: ModelDrafter) -> None:
        self.lookup = lookup
        self.model = model

    def add(self, seqs: list[Sequence]) -> None:
        self.model.add(seqs)

    def drop(self, keep: list[bool]) -> list[int]:
        return self.model.drop(keep)

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        return self._draft(seqs, k, pick, None)

    def propose_steered(self, seqs: list[Sequence], k: int, pick: Picker, steer: Steering) -> Draft:
        return self._draft(seqs, k, pick, steer)

    def _draft(self, seqs: list[Sequence], k: int, pick: Picker, steer: Steering | None) -> Draft:
        lookup = self.lookup.propose(seqs, k, self.model.layout.device)
        lengths = lookup.row_lengths()
        lookup_only = lookup.capped(lengths)
        if bool((lengths == k).all()):
            self.model.skip(seqs)
            return lookup_only
        draft = self.model.draft(seqs, k, pick, steer, forced=(lookup.tokens, lengths))
        # steered not to run the model at all: the n-gram continuations cost nothing and still count
        return lookup_only if draft.width == 0 else draft

    def skip(self, seqs: list[Sequence]) -> None:
        self.model.skip(seqs)

    def backlog(self, seqs: list[Sequence]) -> Backlog:
        return self.model.backlog(seqs)

    def catch_ups(self) -> list[CatchUp]:
        return self.model.catch_ups()

    def begin_stage(self, prompt: list[int], staged: int) -> None:
        self.model.begin_stage(prompt, staged)

    def stage(self, tokens: list[int]) -> None:
        self.model.stage(tokens)

    def unstage(self) -> None:
        self.model.unstage()

    def discard_staged(self) -> None:
        self.model.discard_staged()

    def load(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        self.model.load(rows, seqs)

    def save(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        self.model.save(rows, seqs)

    def counters(self) -> dict[str, float]:
        return self.model.counters()

    def views(self, seqs: list[Sequence], sample_rows: list[int]) -> list[LayoutView]:
        return self.model.views(seqs, sample_rows)
