"""Outputs against the oracle: exact match, partial match, and what kind of divergence it is.

A bench that reports speed without exactness rewards corruption (paper-notes: the fastest
published methods were the wrong ones), so every row of every method is compared with the shared
oracle (`batchspec.forensics.oracle`), and each divergent row is classified by the forensic audit
(fp tie, synchronization error, length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..config import SamplingParams
from ..forensics.audit import Auditor
from ..forensics.audit_inputs import AuditItem
from ..forensics.calibration import Calibration, calibrate_margin
from ..forensics.compare import first_difference
from ..forensics.oracle import Oracle
from ..models import ModelPair

# (prompt ids, method output, oracle output, sampling params) -> the divergence's class
Classifier = Callable[[Sequence[int], Sequence[int], Sequence[int], SamplingParams], str]


@dataclass(frozen=True)
class Match:
    """How one output compares with the oracle's."""

    exact: bool
    partial: float  # share of the oracle's tokens reproduced before the first difference
    divergence: int | None  # first differing position (None when exact)


def compare(output: Sequence[int], reference: Sequence[int]) -> Match:
    if list(output) == list(reference):
        return Match(True, 1.0, None)
    position = first_difference(output, reference)
    return Match(False, position / len(reference) if reference else 0.0, position)


class AuditClassifier:
    """Classifies a divergence with `batchspec.forensics.audit`: the target's logits on the common
    prefix and on the output's continuation decide between an fp tie and a synchronization error.

    The margin is calibrated once, on the first divergence, from this bench's own prompts and
    oracle outputs, so a run without divergences pays nothing for it.
    """

    name = "batchspec.forensics.audit"

    def __init__(self, models: ModelPair, oracle: Oracle, prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams], rows: int = 8) -> None:
        self.models = models
        self.oracle = oracle
        self.prompts = [(list(p), sp) for p, sp in list(zip(prompts, params))[:rows]]
        self.calibration: Calibration | None = None
        self._auditors: dict[SamplingParams, Auditor] = {}

    def __call__(self, prompt: Sequence[int], output: Sequence[int], reference: Sequence[int],
                 params: SamplingParams) -> str:
        """The class of the divergence of `output` (decoded under `params`) from `reference`."""
        if self.calibration is None:
            self.calibration = calibrate_margin(self.models.target, [p for p, _ in self.prompts],
                                                [self.oracle(p, sp) for p, sp in self.prompts])
        if params not in self._auditors:  # one per sampling setting (seeded rows each have their own)
            self._auditors[params] = Auditor(self.models.target, self.models.tokenizer, params.max_new_tokens,
                                             margin=self.calibration.margin, sampling=params)
        item = AuditItem("bench", prompt_ids=list(prompt), token_ids=list(output))
        row = self._auditors[params].audit_row(item, list(reference), self.calibration.margin)
        return str(row.classification)

    def describe(self) -> dict[str, Any]:
        """Who classified, and the fp-tie margin it used (None: nothing diverged, no calibration)."""
        return {"name": self.name, "calibration": asdict(self.calibration) if self.calibration else None}
