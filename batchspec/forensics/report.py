"""What the audit reports: one record per row, totals over them, and a Markdown summary.

Pure functions of the records, so the JSON report and the Markdown summary always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .compare import EXACT, FP_TIE, LENGTH, SYNC_ERROR, UNKNOWN_TOKEN, Continuation

CORRUPTION_FLAGS = ("repetition_loop", "unknown_tokens", "empty", "beyond_eos")


@dataclass
class Divergence:
    """Where an audited output first leaves the oracle, and why."""

    position: int  # index among the oracle's generated tokens
    classification: str
    oracle_token: int | None = None
    audited_token: int | None = None
    oracle_piece: str | None = None
    audited_piece: str | None = None
    logit_gap: float | None = None  # target logit (seeded sampling: score) of the oracle token minus the audited's
    audited_rank: int | None = None  # tokens the target scored above the audited one (0 = argmax)
    # A first divergence within the margin, then plain decoding of the audited prefix not reproducing
    # the rest: a sync error that merely started on a near-tie.
    tie_then_diverged: bool = False
    continuation: Continuation | None = None  # the check of the rest, for first divergences within the margin


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


def totals(rows: list[RowReport]) -> dict[str, Any]:
    """Counts and means over the audited rows (error rows are only counted as errors).
    `tie_then_diverged` is the part of `sync_errors` whose first divergence was within the margin."""
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
        "tie_then_diverged": sum(1 for r in ok if r.divergence is not None and r.divergence.tie_then_diverged),
        "unknown_token_divergences": classes.count(UNKNOWN_TOKEN),
        "length_mismatches": classes.count(LENGTH),
        "mean_partial_match": mean([r.partial_match for r in ok if r.partial_match is not None]),
        "mean_rouge_l": mean([r.rouge_l for r in ok if r.rouge_l is not None]),
        "corruption": {flag: sum(r.flags.get(flag, False) for r in ok) for flag in CORRUPTION_FLAGS},
    }


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", "\\n")


def _class_cell(row: dict[str, Any]) -> str:
    """The class, with where a tie turned into a sync error."""
    d = row["divergence"] or {}
    if d.get("tie_then_diverged"):
        return f"{row['classification']} (tie, then diverged at {d['continuation']['diverged_at']})"
    return row["classification"]


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
        "| exact match | fp ties | sync errors (tie, then diverged) | unknown-token divergences "
        "| length mismatches | mean partial match | mean ROUGE-L |",
        "|---|---|---|---|---|---|---|",
        f"| {t['exact_match']} ({_cell(None if rate is None else 100 * rate)}%) | {t['fp_ties']} "
        f"| {t['sync_errors']} ({t['tie_then_diverged']}) | {t['unknown_token_divergences']} "
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
                    r["id"], _class_cell(r), r["first_divergence"],
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
