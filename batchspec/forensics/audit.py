"""The forensic audit: any run's outputs against plain greedy decoding, token by token.

Throughput numbers and ROUGE scores do not show a batch that lost track of its rows; only a token
comparison with the oracle (each prompt decoded alone, batch 1, no speculation) does. For every
prompt the audit reports exact match, partial match (share of oracle tokens matched before the first
divergence), the first divergence and its class, corruption symptoms, and ROUGE-L:

- `exact`: the same tokens (an output that merely omits the oracle's final stop token counts too,
  since other programs strip it);
- `fp-tie`: at the first divergence the target, run on the common prefix, gives the oracle's token
  and the audited token logits within a calibrated margin, so batch-shape floating-point noise
  alone can flip the choice;
- `sync-error`: anything else (a token the target clearly did not prefer, or output after a stop);
- `length`: no differing token, but one output stops earlier without a stop token (different token
  budgets; pass the run's --max-new-tokens).

The margin comes from measuring, on the audited model in its dtype, how far last-position logits of
batched forwards (HF left padding; our ragged and padded layouts in the verify shape) stray from
batch-1 forwards of the same prefixes.

Outputs of other programs are welcome: rows need an `id` plus `token_ids` or only `text` (which is
re-tokenized and compared with the oracle's visible tokens, special and stop tokens left out).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..config import BatchspecError, SamplingParams
from ..engine import validate_prompt
from ..kv import context_limit, forward_plain, new_dynamic_cache
from ..layouts import make_layout
from ..layouts.base import FILLER_TOKEN
from ..models import eos_token_ids
from ..prompts import PromptRecord
from ..reference import greedy_decode
from .corruption import corruption_flags
from .rouge import rouge_l

EXACT, FP_TIE, SYNC_ERROR, LENGTH = "exact", "fp-tie", "sync-error", "length"
CORRUPTION_FLAGS = ("repetition_loop", "unknown_tokens", "empty", "beyond_eos")

# A flip between two computations needs gap < |noise(oracle token)| + |noise(audited token)|, at most
# twice the largest noise measured; the second factor of 2 covers batch shapes calibration missed.
MARGIN_FACTOR = 4.0
# Rows of the verify-shaped calibration forward: K = 5 drafts plus the pending token, as in a round.
VERIFY_WIDTH = 6
ORACLE_CACHE_FORMAT = 1


@dataclass
class AuditItem:
    """One prompt and the output to audit, or why it cannot be audited (`error`)."""

    id: str
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None  # the audited output as ids ...
    text: str | None = None  # ... or, from programs that write only text, as text
    error: str | None = None


@dataclass
class Divergence:
    """Where an audited output first leaves the oracle, and why."""

    position: int  # index among the generated tokens
    classification: str
    oracle_token: int | None = None
    audited_token: int | None = None
    oracle_piece: str | None = None
    audited_piece: str | None = None
    logit_gap: float | None = None  # target logit of the oracle token minus the audited token's
    audited_rank: int | None = None  # tokens the target scored above the audited one (0 = argmax)


@dataclass
class RowReport:
    id: str
    error: str | None = None
    classification: str | None = None
    exact_match: bool = False
    partial_match: float | None = None
    first_divergence: int | None = None
    divergence: Divergence | None = None
    rouge_l: float | None = None
    flags: dict[str, bool] = field(default_factory=dict)
    oracle_tokens: int | None = None
    audited_tokens: int | None = None
    oracle_text: str | None = None
    audited_text: str | None = None


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


# ---- reading the inputs ------------------------------------------------------------------------


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _output_item(obj: Any, line_no: int) -> AuditItem:
    if not isinstance(obj, dict):
        return AuditItem(f"line {line_no}", error="output line is not a JSON object")
    if obj.get("id") is None:
        return AuditItem(f"line {line_no}", error="output row has no `id`")
    item = AuditItem(str(obj["id"]), prompt_ids=_int_list(obj.get("prompt_token_ids")) or None)
    if obj.get("error"):
        item.error = f"the run reported an error: {obj['error']}"
    elif _int_list(obj.get("token_ids")) is not None:
        item.token_ids = _int_list(obj["token_ids"])
    elif isinstance(obj.get("text"), str):
        item.text = obj["text"]
    else:
        item.error = "output row has neither `token_ids` (a list of ints) nor `text`"
    return item


def read_outputs(path: str | Path) -> list[AuditItem]:
    """Output rows of any program, one JSON object a line; unreadable lines become error items."""
    path = Path(path)
    if not path.is_file():
        raise BatchspecError(f"outputs file not found: {path}")
    items = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(_output_item(json.loads(line), i))
        except json.JSONDecodeError as err:
            items.append(AuditItem(f"line {i}", error=f"invalid JSON on line {i}: {err.msg}"))
    return items


def pair_items(
    prompts: list[PromptRecord], outputs: list[AuditItem], encode: Callable[[str], list[int]]
) -> list[AuditItem]:
    """Match outputs to prompts by id, in prompt order, then outputs without a prompt.

    Nothing is dropped: a prompt without output, an output without prompt, duplicates and
    unencodable prompts all come back as items with an error. An output's own `prompt_token_ids`
    win over re-encoding the prompt text (they are what the run actually decoded).
    """
    by_id: dict[str, AuditItem] = {}
    items: list[AuditItem] = []
    for out in outputs:
        if out.id in by_id:
            items.append(AuditItem(out.id, error="duplicate output id (only the first is audited)"))
        else:
            by_id[out.id] = out
    paired: list[AuditItem] = []
    seen: set[str] = set()
    for record in prompts:
        if record.id in seen:
            paired.append(AuditItem(record.id, error="duplicate prompt id (only the first is audited)"))
            continue
        seen.add(record.id)
        item = by_id.pop(record.id, None)
        if item is None:
            paired.append(AuditItem(record.id, error="no output for this prompt"))
            continue
        if item.error is None and not item.prompt_ids:
            if record.error is not None:
                item = replace(item, error=f"prompt unreadable: {record.error}")
            else:
                try:
                    item = replace(item, prompt_ids=encode(record.text))
                except BatchspecError as err:
                    item = replace(item, error=f"prompt: {err}")
        paired.append(item)
    # An unreadable line has no real id; its own error says more than "no prompt".
    paired.extend(AuditItem(item.id, error=item.error or "no prompt with this id") for item in by_id.values())
    return paired + items


# ---- the oracle and its cache ------------------------------------------------------------------


def model_identity(model: PreTrainedModel) -> str:
    """A short fingerprint of the weights, dtype, device type and attention kernel: what the
    oracle's tokens depend on.

    Hashing the first values of every parameter is cheap even for billions of weights and changes
    with any other checkpoint, fine-tune or dtype, unlike the folder name.
    """
    digest = hashlib.sha256()
    config = model.config
    device = next(model.parameters()).device.type
    digest.update(f"{config.model_type}|{model.dtype}|{device}|{getattr(config, '_attn_implementation', '')}".encode())
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(str(tuple(param.shape)).encode())
        digest.update(param.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class OracleCache:
    """Oracle outputs saved as JSON, keyed by model identity + max_new_tokens + stop ids + prompt ids."""

    def __init__(self, path: Path | None, model_key: str) -> None:
        self.path = path
        self.model_key = model_key
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("format") != ORACLE_CACHE_FORMAT or not isinstance(data.get("entries"), dict):
                    raise ValueError("unknown format")
            except (ValueError, AttributeError) as err:
                raise BatchspecError(
                    f"{path} is not a batchspec oracle cache ({err}); delete it or pass another file"
                ) from None
            self.entries = data["entries"]

    def key(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: Collection[int]) -> str:
        material = json.dumps([self.model_key, max_new_tokens, sorted(stop_ids), prompt_ids])
        return hashlib.sha256(material.encode()).hexdigest()

    def get(self, key: str) -> list[int] | None:
        entry = self.entries.get(key)
        return list(entry["token_ids"]) if entry else None

    def put(self, key: str, item_id: str, token_ids: list[int]) -> None:
        self.entries[key] = {"id": item_id, "token_ids": token_ids}
        self.dirty = True

    def save(self) -> None:
        """Write atomically, so an interrupted audit never leaves a truncated cache behind."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"format": ORACLE_CACHE_FORMAT, "entries": self.entries}), encoding="utf-8")
        os.replace(tmp, self.path)
        self.dirty = False


def oracle_outputs(
    model: PreTrainedModel,
    items: list[AuditItem],
    max_new_tokens: int,
    stop_ids: Collection[int],
    cache: OracleCache,
) -> dict[str, list[int]]:
    """Plain greedy decoding of every auditable item's prompt alone (cached ones are not recomputed)."""
    oracle: dict[str, list[int]] = {}
    todo = []
    for item in items:
        key = cache.key(item.prompt_ids, max_new_tokens, stop_ids)
        hit = cache.get(key)
        if hit is None:
            todo.append((item, key))
        else:
            oracle[item.id] = hit
    try:
        for item, key in tqdm(todo, desc="oracle", unit="prompt", file=sys.stderr):
            oracle[item.id] = greedy_decode(model, item.prompt_ids, max_new_tokens, stop_ids)
            cache.put(key, item.id, oracle[item.id])
    finally:  # keep what was computed, even when interrupted
        cache.save()
    return oracle


# ---- calibrating the fp-tie margin ---------------------------------------------------------------


@torch.inference_mode()
def prefix_logits(model: PreTrainedModel, prefix: list[int]) -> torch.Tensor:
    """Last-position logits [vocab] of one prefix, alone, on transformers' own cache and masks."""
    device = next(model.parameters()).device
    return forward_plain(model, torch.tensor([prefix], device=device), new_dynamic_cache(model))[0]


@torch.inference_mode()
def _left_padded_logits(model: PreTrainedModel, prefixes: list[list[int]]) -> torch.Tensor:
    """Last-position logits [b, vocab] of one left-padded batch, the way HF `generate` batches."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), width), FILLER_TOKEN, dtype=torch.long, device=device)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long, device=device)
    for b, p in enumerate(prefixes):
        ids[b, width - len(p) :] = torch.tensor(p, device=device)
        mask[b, width - len(p) :] = 1
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1)
    return out.logits[:, -1].float()


def _verify_shaped_logits(model: PreTrainedModel, kind: str, prefixes: list[list[int]], width: int) -> torch.Tensor:
    """Last-position logits [b, vocab] when one of our layouts prefills all but `width` tokens of
    each prefix and then feeds the last `width` at once, as a verification round does."""
    layout = make_layout(kind, model, len(prefixes), max(len(p) for p in prefixes))
    layout.prefill([p[:-width] for p in prefixes])
    tokens = torch.tensor([p[-width:] for p in prefixes], dtype=torch.long, device=layout.device)
    return layout.forward(tokens)[:, -1]


def calibrate_margin(model: PreTrainedModel, prefixes: list[list[int]]) -> Calibration:
    """Measure batch-shape logit noise on `prefixes` and derive the fp-tie margin from it."""
    dtype = str(model.dtype).removeprefix("torch.")
    single = torch.stack([prefix_logits(model, p) for p in prefixes])
    noise = {"hf-left-padded": float((_left_padded_logits(model, prefixes) - single).abs().max())}
    width = min(VERIFY_WIDTH, min(len(p) for p in prefixes) - 1)
    if width >= 1:
        for kind in ("ragged", "padded"):
            batched = _verify_shaped_logits(model, kind, prefixes, width)
            noise[f"{kind}-verify"] = float((batched - single).abs().max())
    max_noise = max(noise.values())
    floor = torch.finfo(model.dtype).eps * float(single.abs().max())
    return Calibration(
        dtype=dtype,
        margin=max(MARGIN_FACTOR * max_noise, floor),
        source="calibrated",
        prefixes=len(prefixes),
        noise=noise,
        max_noise=max_noise,
        floor=floor,
    )


# ---- comparing one output ----------------------------------------------------------------------


def classify_gap(
    logits: torch.Tensor, oracle_token: int, audited_token: int, margin: float
) -> tuple[str, float | None, int | None]:
    """(class, logit gap, audited rank) of a divergence, from the target's logits [vocab] on the
    common prefix: a tie within `margin` is floating-point noise, anything else a sync error."""
    if not 0 <= audited_token < logits.shape[-1]:
        return SYNC_ERROR, None, None
    gap = float(logits[oracle_token] - logits[audited_token])
    rank = int((logits > logits[audited_token]).sum())
    return (FP_TIE if abs(gap) <= margin else SYNC_ERROR), gap, rank


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Comparison:
    """How an output lines up with its oracle, before any logits are looked at."""

    kind: str  # EXACT, "token" (a differing token, to classify), SYNC_ERROR (output past a stop) or LENGTH
    matched: int  # compared oracle tokens matched before the divergence
    compared: int  # oracle tokens compared (all of them for ids, the visible ones for text)
    position: int | None = None  # in the oracle's generated tokens
    oracle_token: int | None = None
    audited_token: int | None = None


def compare_ids(oracle: list[int], audited: list[int], stop_ids: Collection[int]) -> Comparison:
    """Compare token ids as generated."""
    m = _first_difference(oracle, audited)
    n = len(oracle)
    if m < len(audited) and m < n:
        return Comparison("token", m, n, m, oracle[m], audited[m])
    if len(audited) == n or (len(audited) == n - 1 and oracle[-1] in stop_ids):
        return Comparison(EXACT, n, n)
    if len(audited) > n and n and oracle[-1] in stop_ids:
        return Comparison(SYNC_ERROR, m, n, m, None, audited[m])  # kept going after the stop token
    return Comparison(LENGTH, m, n, m, oracle[m] if m < n else None, audited[m] if m < len(audited) else None)


def compare_visible(oracle: list[int], audited: list[int], hidden: Collection[int]) -> Comparison:
    """Compare re-tokenized text with the oracle's visible tokens (text cannot show special or stop
    tokens), reporting positions in the oracle's generated tokens. Hidden tokens before a divergence
    are assumed to have been generated by the audited program too."""
    index = [i for i, t in enumerate(oracle) if t not in hidden]
    visible = [oracle[i] for i in index]
    m = _first_difference(visible, audited)
    n = len(visible)
    if m < len(audited) and m < n:
        return Comparison("token", m, n, index[m], visible[m], audited[m])
    if len(audited) == n:
        return Comparison(EXACT, n, n)
    after = index[-1] + 1 if index else 0
    if len(audited) > n and after < len(oracle):  # the oracle stopped here (hidden stop token)
        return Comparison("token", m, n, after, oracle[after], audited[m])
    return Comparison(LENGTH, m, n, index[m] if m < n else after)


# ---- the audit ---------------------------------------------------------------------------------


class Auditor:
    """Audits items against one target model."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        oracle_cache: Path | None = None,
        margin: float | None = None,
        calibration_rows: int = 8,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(eos_token_ids(model, tokenizer))
        self.hidden = frozenset(tokenizer.all_special_ids) | self.stop_ids
        self.identity = model_identity(model)
        self.cache = OracleCache(oracle_cache, self.identity)
        self.margin = margin
        self.calibration_rows = calibration_rows

    def audit(self, items: list[AuditItem]) -> dict[str, Any]:
        """The full report: config, margin calibration, totals and one record per item."""
        items = [self._servable(item) for item in items]
        valid = [i for i in items if i.error is None]
        oracle = oracle_outputs(self.model, valid, self.max_new_tokens, self.stop_ids, self.cache)
        calibration = self._calibration(valid, oracle)
        rows = [
            RowReport(item.id, item.error) if item.error else self.audit_row(item, oracle[item.id], calibration.margin)
            for item in items
        ]
        return {
            "config": {
                "max_new_tokens": self.max_new_tokens,
                "stop_ids": sorted(self.stop_ids),
                "model_identity": self.identity,
                "dtype": str(self.model.dtype).removeprefix("torch."),
            },
            "calibration": asdict(calibration),
            "totals": totals(rows),
            "rows": [asdict(r) for r in rows],
        }

    def _servable(self, item: AuditItem) -> AuditItem:
        """The item, or a copy with an error when plain decoding could not serve its prompt either."""
        if item.error is not None:
            return item
        try:
            params = SamplingParams(max_new_tokens=self.max_new_tokens)
            validate_prompt(item.prompt_ids or [], params, context_limit(self.model))
        except BatchspecError as err:
            return replace(item, error=f"prompt: {err}")
        return item

    def _calibration(self, valid: list[AuditItem], oracle: dict[str, list[int]]) -> Calibration:
        dtype = str(self.model.dtype).removeprefix("torch.")
        if self.margin is not None:
            return Calibration(dtype=dtype, margin=self.margin, source="given")
        # Prefixes as the audit meets them: prompt plus half of the oracle's continuation.
        prefixes = [i.prompt_ids + oracle[i.id][: len(oracle[i.id]) // 2] for i in valid[: self.calibration_rows]]
        if not prefixes:
            return Calibration(dtype=dtype, margin=0.0, source="calibrated")
        return calibrate_margin(self.model, prefixes)

    def audit_row(self, item: AuditItem, oracle: list[int], margin: float) -> RowReport:
        """Compare one output with its oracle and classify the first divergence."""
        assert item.prompt_ids is not None
        oracle_text = self.tokenizer.decode(oracle, skip_special_tokens=True)
        if item.token_ids is not None:
            audited = item.token_ids
            audited_text = self.tokenizer.decode(audited, skip_special_tokens=True)
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
                audited, audited_text, oracle, oracle_text, self.stop_ids, self.tokenizer.unk_token_id
            ),
            oracle_tokens=len(oracle),
            audited_tokens=len(audited),
            oracle_text=oracle_text,
            audited_text=audited_text,
        )
        if comparison.kind != EXACT:
            row.divergence = self._divergence(item.prompt_ids, oracle, comparison, margin)
            row.classification = row.divergence.classification
        return row

    def _divergence(self, prompt_ids: list[int], oracle: list[int], c: Comparison, margin: float) -> Divergence:
        assert c.position is not None
        div = Divergence(
            position=c.position,
            classification=SYNC_ERROR if c.kind == "token" else c.kind,
            oracle_token=c.oracle_token,
            audited_token=c.audited_token,
            oracle_piece=self._piece(c.oracle_token),
            audited_piece=self._piece(c.audited_token),
        )
        if c.kind == "token":
            assert c.oracle_token is not None and c.audited_token is not None
            logits = prefix_logits(self.model, prompt_ids + oracle[: c.position])
            div.classification, div.logit_gap, div.audited_rank = classify_gap(
                logits, c.oracle_token, c.audited_token, margin
            )
        return div

    def _piece(self, token: int | None) -> str | None:
        return None if token is None else self.tokenizer.decode([token])


def totals(rows: list[RowReport]) -> dict[str, Any]:
    """Counts and means over the audited rows (error rows are only counted as errors)."""
    ok = [r for r in rows if r.error is None]
    classes = [r.classification for r in ok]

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    return {
        "rows": len(rows),
        "audited": len(ok),
        "errors": len(rows) - len(ok),
        "exact_match": classes.count(EXACT),
        "exact_match_rate": mean([float(c == EXACT) for c in classes]),
        "fp_ties": classes.count(FP_TIE),
        "sync_errors": classes.count(SYNC_ERROR),
        "length_mismatches": classes.count(LENGTH),
        "mean_partial_match": mean([r.partial_match for r in ok if r.partial_match is not None]),
        "mean_rouge_l": mean([r.rouge_l for r in ok if r.rouge_l is not None]),
        "corruption": {flag: sum(r.flags.get(flag, False) for r in ok) for flag in CORRUPTION_FLAGS},
    }


# ---- the readable summary ----------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", "\\n")


def markdown_summary(report: dict[str, Any], max_rows: int = 30) -> str:
    """Totals, the margin, then the divergent and failed rows (first `max_rows` of each)."""
    t, cal = report["totals"], report["calibration"]
    rate = t["exact_match_rate"]
    margin = f"fp-tie margin {cal['margin']:.3g} logits ({cal['source']}"
    if cal["max_noise"] is not None:
        margin += f"; largest batch-shape noise {cal['max_noise']:.3g} over {cal['prefixes']} prefixes"
    lines = [
        "# batchspec audit",
        "",
        f"{t['audited']} of {t['rows']} rows audited ({t['errors']} errors); "
        f"max_new_tokens {report['config']['max_new_tokens']}, dtype {report['config']['dtype']}.",
        margin + ").",
        "",
        "| exact match | fp ties | sync errors | length mismatches | mean partial match | mean ROUGE-L |",
        "|---|---|---|---|---|---|",
        f"| {t['exact_match']} ({_cell(None if rate is None else 100 * rate)}%) | {t['fp_ties']} | {t['sync_errors']} "
        f"| {t['length_mismatches']} | {_cell(t['mean_partial_match'])} | {_cell(t['mean_rouge_l'])} |",
        "",
        "Corruption flags (symptoms the oracle does not share): "
        + ", ".join(f"{name} {count}" for name, count in t["corruption"].items()),
    ]
    divergent = [r for r in report["rows"] if r["error"] is None and r["classification"] != EXACT]
    if divergent:
        lines += [
            "",
            "## Divergences",
            "",
            "| id | class | position | oracle token | audited token | logit gap | rank | partial | ROUGE-L | flags |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in divergent[:max_rows]:
            d = r["divergence"] or {}
            flags = " ".join(name for name, on in r["flags"].items() if on)
            lines.append(
                "| " + " | ".join(_cell(v) for v in (
                    r["id"], r["classification"], r["first_divergence"],
                    None if d.get("oracle_piece") is None else repr(d["oracle_piece"]),
                    None if d.get("audited_piece") is None else repr(d["audited_piece"]),
                    d.get("logit_gap"), d.get("audited_rank"), r["partial_match"], r["rouge_l"], flags,
                )) + " |"
            )
        if len(divergent) > max_rows:
            lines.append(f"\n... and {len(divergent) - max_rows} more (see the JSON report).")
    failed = [r for r in report["rows"] if r["error"] is not None]
    if failed:
        lines += ["", "## Rows not audited", "", "| id | error |", "|---|---|"]
        lines += [f"| {_cell(r['id'])} | {_cell(r['error'])} |" for r in failed[:max_rows]]
        if len(failed) > max_rows:
            lines.append(f"\n... and {len(failed) - max_rows} more (see the JSON report).")
    return "\n".join(lines) + "\n"
