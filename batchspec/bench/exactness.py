"""Outputs against the oracle: exact match, partial match, and what kind of divergence it is.

A bench that reports speed without exactness rewards corruption (paper-notes: the fastest
published methods were the wrong ones), so every row of every method is compared here, and each
divergent row is classified by the forensic audit (fp tie, synchronization error, length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..config import SamplingParams
from ..forensics.audit import Auditor, AuditItem, Calibration, calibrate_margin
from ..models import ModelPair
from ..reference import reference_decode

# (prompt ids, method output, oracle output) -> the divergence's class
Classifier = Callable[[Sequence[int], Sequence[int], Sequence[int]], str]


@dataclass(frozen=True)
class Match:
    """How one output compares with the oracle's."""

    exact: bool
    partial: float  # share of the oracle's tokens reproduced before the first difference
    divergence: int | None  # first differing position (None when exact)


def compare(output: Sequence[int], reference: Sequence[int]) -> Match:
    if list(output) == list(reference):
        return Match(True, 1.0, None)
    position = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))
    return Match(False, position / len(reference) if reference else 0.0, position)


class Oracle:
    """Plain greedy batch-1 decoding of each prompt alone, computed once per prompt and kept in
    memory, so every method is compared with the same reference at the cost of one decode."""

    def __init__(self, target: torch.nn.Module, params: SamplingParams, stop_ids: Sequence[int]) -> None:
        self.target = target
        self.params = params
        self.stop_ids = tuple(stop_ids)
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt_ids: Sequence[int]) -> list[int]:
        key = tuple(prompt_ids)
        if key not in self._cache:
            self._cache[key] = reference_decode(self.target, list(key), self.params, self.stop_ids)
        return self._cache[key]


class AuditClassifier:
    """Classifies a divergence with `batchspec.forensics.audit`: the target's logits on the common
    prefix decide between an fp tie (gap within the calibrated margin) and a synchronization error.

    The margin is calibrated once, on the first divergence, from this bench's own prompts and
    oracle outputs, so a run without divergences pays nothing for it.
    """

    name = "batchspec.forensics.audit"

    def __init__(self, models: ModelPair, oracle: Oracle, prompts: Sequence[Sequence[int]], rows: int = 8) -> None:
        self.models = models
        self.oracle = oracle
        self.prompts = [list(p) for p in prompts[:rows]]
        self.calibration: Calibration | None = None
        self._auditor: Auditor | None = None

    def __call__(self, prompt: Sequence[int], output: Sequence[int], reference: Sequence[int]) -> str:
        if self._auditor is None or self.calibration is None:
            # prefixes as the audit meets them: a prompt plus half of its oracle continuation
            prefixes = [p + self.oracle(p)[: len(self.oracle(p)) // 2] for p in self.prompts]
            self.calibration = calibrate_margin(self.models.target, prefixes)
            self._auditor = Auditor(
                self.models.target, self.models.tokenizer, self.oracle.params.max_new_tokens,
                margin=self.calibration.margin,
            )
        item = AuditItem("bench", prompt_ids=list(prompt), token_ids=list(output))
        row = self._auditor.audit_row(item, list(reference), self.calibration.margin)
        return str(row.classification)

    def describe(self) -> dict[str, Any]:
        """Who classified, and the fp-tie margin it used (None: nothing diverged, no calibration)."""
        return {"name": self.name, "calibration": asdict(self.calibration) if self.calibration else None}
