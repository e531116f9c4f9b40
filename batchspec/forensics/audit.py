"""The forensic audit: any run's outputs against plain decoding, token by token.

Throughput numbers and ROUGE scores do not show a batch that lost track of its rows; only a token
comparison with the oracle (each prompt decoded alone, batch 1, no speculation) does. For every
prompt the audit reports exact match, partial match (share of oracle tokens matched before the first
divergence), the first divergence and its class (`compare`: exact, fp-tie, sync-error,
unknown-token, length), corruption symptoms, and ROUGE-L.

This module ties the pieces together: `audit_inputs` reads and pairs the rows, `oracle` decodes
(and caches) the reference, `calibration` measures the fp-tie margin, `compare` lines outputs up
and classifies divergences, `report` sums up.

Outputs of other programs are welcome: rows need an `id` plus `token_ids` or only `text`. Text is
re-tokenized and compared with the oracle's visible tokens (special and stop tokens left out). The
continuation after a tie is then checked on the re-tokenized ids, with two allowances for what text
cannot say: a difference where the expected and the re-tokenized token may spell the same text
split at another boundary (one token's text a proper prefix of the other's) is excused, since
re-tokenizing can merge or split the tokens a program generated; and a special token (not a stop
token) that plain decoding emits is assumed generated and inserted, as before the first divergence.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..admission import validate_prompt
from ..config import BatchspecError, SamplingParams
from ..kv import context_limit, forward_all_positions
from ..models import eos_token_ids, output_vocab_size
from ..roles import prompt_pass
from .audit_inputs import AuditItem
from .calibration import Calibration, calibrate_margin, dtype_name
from .compare import (
    EXACT,
    FP_TIE,
    SYNC_ERROR,
    TOKEN,
    UNKNOWN_TOKEN,
    Comparison,
    Continuation,
    check_continuation,
    classify_gap,
    compare_ids,
    compare_visible,
    plain_scores,
)
from .corruption import corruption_flags
from .oracle import Oracle
from .report import Divergence, RowReport, totals
from .rouge import rouge_l

# Special tokens assumed into one text output's continuation before giving up on it (each costs a forward).
MAX_HIDDEN_INSERTIONS = 8


def model_id_limit(model: PreTrainedModel) -> int:
    """Ids the model can take as input and score as output: [0, limit). May exceed the tokenizer's
    vocabulary (Qwen pads its embedding and LM head to a multiple of 128)."""
    return min(output_vocab_size(model), int(model.get_input_embeddings().num_embeddings))


class Auditor:
    """Audits items against one target model.

    `sampling` audits seeded (coupled) sampling instead of greedy decoding (the bench's sampled
    runs); its token budget is `max_new_tokens`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        oracle_cache: Path | None = None,
        margin: float | None = None,
        calibration_rows: int = 8,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.params = replace(sampling or SamplingParams(), max_new_tokens=max_new_tokens)
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(eos_token_ids(model, tokenizer)) | frozenset(self.params.stop_token_ids)
        self.hidden = frozenset(tokenizer.all_special_ids) | self.stop_ids
        self.oracle = Oracle(model, self.params, self.stop_ids, oracle_cache)
        self.margin = margin
        self.calibration_rows = calibration_rows
        self.known_ids = len(tokenizer)  # ids the tokenizer can decode: [0, known_ids)
        self.id_limit = model_id_limit(model)

    def audit(self, items: list[AuditItem]) -> dict[str, Any]:
        """The full report: config, margin calibration, totals and one record per item."""
        items = [self._servable(item) for item in items]
        valid = [i for i in items if i.error is None]
        self.oracle.precompute([i.prompt_ids for i in valid])
        oracle = {i.id: self.oracle(i.prompt_ids) for i in valid}
        calibration = self._calibration(valid, oracle)
        rows = [
            RowReport(item.id, item.error) if item.error else self.audit_row(item, oracle[item.id], calibration.margin)
            for item in items
        ]
        return {
            "config": {
                "max_new_tokens": self.max_new_tokens,
                "stop_ids": sorted(self.stop_ids),
                "model_identity": self.oracle.identity,
                "dtype": dtype_name(self.model),
            },
            "calibration": asdict(calibration),
            "totals": totals(rows),
            "rows": [asdict(r) for r in rows],
        }

    def _servable(self, item: AuditItem) -> AuditItem:
        """The item, or a copy with an error when its ids cannot be fed to the model or plain
        decoding could not serve its prompt either."""
        if item.error is not None:
            return item
        for name, ids in (("prompt_token_ids", item.prompt_ids), ("token_ids", item.token_ids)):
            bad = next((t for t in ids or () if not 0 <= t < self.id_limit), None)
            if bad is not None:
                return replace(item, error=f"`{name}` holds id {bad}, outside the model's ids [0, {self.id_limit})")
        try:
            validate_prompt(item.prompt_ids or [], self.params, context_limit(self.model))
        except BatchspecError as err:
            return replace(item, error=f"prompt: {err}")
        return item

    def _calibration(self, valid: list[AuditItem], oracle: dict[str, list[int]]) -> Calibration:
        if self.margin is not None:
            return Calibration(dtype=dtype_name(self.model), margin=self.margin, source="given")
        chosen = valid[: self.calibration_rows]
        return calibrate_margin(self.model, [i.prompt_ids for i in chosen], [oracle[i.id] for i in chosen])

    def audit_row(self, item: AuditItem, oracle: list[int], margin: float) -> RowReport:
        """Compare one output with its oracle and classify the first divergence."""
        assert item.prompt_ids is not None
        oracle_text = self._decode(oracle)
        if item.token_ids is not None:
            audited = item.token_ids
            audited_text = self._decode(audited)
            comparison = compare_ids(oracle, audited, self.stop_ids)
        else:
            audited_text = item.text or ""
            audited = list(self.tokenizer.encode(audited_text, add_special_tokens=False))
            comparison = compare_visible(oracle, audited, self.hidden)
            if audited_text == oracle_text:  # ids may differ only by a non-canonical tokenization
                comparison = Comparison(EXACT, comparison.compared, comparison.compared)
        row = RowReport(
            item.id,
            classification=comparison.kind,
            exact_match=comparison.kind == EXACT,
            partial_match=(
                comparison.matched / comparison.compared if comparison.compared else float(comparison.kind == EXACT)
            ),
            first_divergence=comparison.position,
            rouge_l=rouge_l(audited_text, oracle_text),
            flags=corruption_flags(
                audited, audited_text, oracle, oracle_text, self.stop_ids, self.tokenizer.unk_token_id, self.known_ids
            ),
            oracle_tokens=len(oracle),
            audited_tokens=len(audited),
            oracle_text=oracle_text,
            audited_text=audited_text,
        )
        if comparison.kind != EXACT:
            row.divergence = self._divergence(item.prompt_ids, oracle, audited, comparison, margin, item.text is not None)
            row.classification = row.divergence.classification
        return row

    def _divergence(
        self, prompt_ids: list[int], oracle: list[int], audited: list[int], c: Comparison, margin: float, text: bool
    ) -> Divergence:
        """Classify a divergence. A differing token is judged on one teacher-forced forward over the
        prompt, the common prefix and the audited tokens from the divergent one on (as far as plain
        decoding could go within the token budget): its first position decides tie or not, the later
        ones whether plain decoding of the audited prefix reproduces the rest."""
        assert c.position is not None
        div = Divergence(
            position=c.position,
            classification=SYNC_ERROR if c.kind == TOKEN else c.kind,
            oracle_token=c.oracle_token,
            audited_token=c.audited_token,
            oracle_piece=self._piece(c.oracle_token),
            audited_piece=self._piece(c.audited_token),
        )
        if c.kind != TOKEN:
            return div
        assert c.oracle_token is not None and c.audited_token is not None and c.audited_index is not None
        prefix = prompt_ids + oracle[: c.position]
        tokens = audited[c.audited_index : c.audited_index + self.max_new_tokens - c.position]
        scores = self._scores(prefix, tokens, c.position)
        first, div.logit_gap, div.audited_rank = classify_gap(scores[0], c.oracle_token, c.audited_token, margin)
        if not self._known(c.audited_token):
            div.classification = UNKNOWN_TOKEN
            return div
        if first != FP_TIE:
            return div
        cont = self._continuation(prefix, tokens, scores, c, margin, text)
        div.continuation = cont
        if cont.diverged_at is None:
            div.classification = FP_TIE
        elif cont.diverged_token is not None and not self._known(cont.diverged_token):
            div.classification = UNKNOWN_TOKEN
        else:
            div.tie_then_diverged = True
        return div

    def _scores(self, prefix: list[int], tokens: list[int], position: int) -> torch.Tensor:
        """Plain decoding's scores [len(tokens), vocab] for each of `tokens` after `prefix` (row i sees
        tokens[:i]), from one teacher-forced forward; `position` is tokens[0]'s generated position, so
        the prefix's first len(prefix) - position tokens are the prompt, computed as plain decoding
        computes a prompt (`roles.prompt_pass`)."""
        with prompt_pass(len(prefix) - position):
            logits = forward_all_positions(self.model, prefix + tokens[:-1], len(tokens))
        return plain_scores(logits, self.params, range(position, position + len(tokens)))

    def _continuation(
        self, prefix: list[int], tokens: list[int], scores: torch.Tensor, c: Comparison, margin: float, text: bool
    ) -> Continuation:
        """Check the audited tokens after a first divergence within the margin.

        Text cannot show special tokens: where plain decoding of a text output's prefix emits one
        (other than a stop token), it is assumed the program generated it too, as before the first
        divergence; it is inserted and the rest re-scored with one more forward (at most
        MAX_HIDDEN_INSERTIONS times a row).
        """
        assert c.audited_index is not None and c.position is not None
        same_text = self._same_text if text else None
        inserted = 0
        while True:
            # indices in `tokens` run `inserted` ahead of the audited tokens from the divergence on
            cont = check_continuation(scores, tokens, c.audited_index - inserted, margin, self.stop_ids, same_text)
            expected = cont.expected_token
            if not (text and expected in self.hidden - self.stop_ids and inserted < MAX_HIDDEN_INSERTIONS):
                cont.hidden = inserted
                return cont
            assert cont.diverged_at is not None
            i = cont.diverged_at - (c.audited_index - inserted)
            tokens = (tokens[:i] + [expected] + tokens[i:])[: self.max_new_tokens - c.position]
            inserted += 1
            scores = self._scores(prefix, tokens, c.position)

    def _known(self, token: int) -> bool:
        return 0 <= token < self.known_ids

    def _decode(self, ids: list[int]) -> str:
        """Text of ids the tokenizer knows (unknown ones are flagged, not decoded: some tokenizers
        raise on them, others drop them silently)."""
        return self.tokenizer.decode([t for t in ids if self._known(t)], skip_special_tokens=True)

    def _piece(self, token: int | None) -> str | None:
        return None if token is None or not self._known(token) else self.tokenizer.decode([token])

    def _same_text(self, expected: int, audited: int) -> bool:
        """Whether two tokens may be one text split at different boundaries (one's text a proper
        prefix of the other's): re-tokenizing an output can merge or split the tokens it was made of."""
        a, b = self._piece(expected), self._piece(audited)
        return bool(a) and bool(b) and a != b and (a.startswith(b) or b.startswith(a))
