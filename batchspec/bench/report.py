"""Figures from bench runs: per method (and per task group), as JSON, CSV and fixed-width tables.

Pure functions of the runs: nothing here times or decodes anything, so every number in the
tables, the JSON, the CSV and the plots comes from the same dictionaries.
"""

from __future__ import annotations

import csv
import operator
import os
import platform
from collections.abc import Iterable
from datetime import datetime, timezone
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from ..costs import MeasuredCosts, break_even, cpu_description
from ..forensics.compare import FP_TIE, SYNC_ERROR
from .exactness import Match
from .methods import BASELINE_SPEC
from .runner import ALL, MethodResult, RowResult, Timing
from .specbench import BenchPrompt, group_order

NOISE_NOTE = (
    "Ratios are side-by-side measurements of all methods in one process, on the same prompts and "
    "models, on a shared and noisy machine: compare methods within this run, not across runs."
)


def machine_info(dtype: str, draft_dtype: str, device: str) -> dict[str, Any]:
    """Enough of the machine to tell whether two bench runs are comparable at all."""
    return {
        "cpu": cpu_description(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dtype": dtype,
        "draft_dtype": draft_dtype,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4)}


def _ratio(num: float, den: float, digits: int = 3) -> float | None:
    return round(num / den, digits) if den > 0 else None


def figures(
    rows: list[RowResult],
    matches: list[Match | None],
    labels: list[str | None],
    timing: Timing | None,
) -> dict[str, Any]:
    """Everything the bench reports for one set of rows. Speed needs `timing` (rows decoded in
    one run); without it (a task group inside a mixed run) speed figures are None."""
    ok = [i for i, r in enumerate(rows) if r.error is None]
    tokens = sum(len(rows[i].token_ids) for i in ok)
    decode_tokens = sum(max(len(rows[i].token_ids) - 1, 0) for i in ok)  # the first token is prefill's
    rounds = sum(rows[i].rounds for i in ok)
    drafted = sum(rows[i].drafted for i in ok)
    accepted = sum(rows[i].accepted for i in ok)
    exact = sum(1 for i in ok if matches[i] is not None and matches[i].exact)
    divergent = [labels[i] for i in ok if labels[i] is not None]
    out: dict[str, Any] = {
        "prompts": len(rows),
        "errors": len(rows) - len(ok),
        "generated_tokens": tokens,
        "wall_s": None, "prefill_s": None, "decode_s": None,
        "tokens_per_s": None, "decode_tokens_per_s": None,
        "speedup": None, "decode_speedup": None,
        # tokens a row gains per verification round (ar: 1.0), and the share of drafts accepted
        "mean_accepted_length": _ratio(sum(rows[i].round_tokens for i in ok), rounds),
        "acceptance_rate": _ratio(accepted, drafted, 4),
        "time_share": None,
        "latency_s": _percentiles([rows[i].latency for i in ok if rows[i].latency is not None]),
        "ttft_s": _percentiles([rows[i].ttft for i in ok if rows[i].ttft is not None]),
        "itl_s": _percentiles([gap for i in ok for gap in rows[i].gaps]),
        "prefill_tokens_per_s": None, "padding_share": None,
        "exact_matches": exact,
        "exact_match": _ratio(exact, len(ok), 4),
        "partial_match": _ratio(sum(matches[i].partial for i in ok if matches[i] is not None), len(ok), 4),
        # every divergence, then by class (the rest are length mismatches)
        "divergent": len(divergent),
        "fp_ties": divergent.count(FP_TIE),
        "sync_errors": divergent.count(SYNC_ERROR),
        **_chosen(rows[i] for i in ok),
    }
    if timing is not None:
        decode = timing.wall - timing.prefill
        out.update(
            wall_s=round(timing.wall, 4), prefill_s=round(timing.prefill, 4), decode_s=round(decode, 4),
            tokens_per_s=_ratio(tokens, timing.wall), decode_tokens_per_s=_ratio(decode_tokens, decode),
            prefill_tokens_per_s=_ratio(timing.prefill_tokens, timing.prefill),
            # token positions the prefill computed that were not prompt tokens (padding)
            padding_share=_ratio(timing.prefill_fed - timing.prefill_tokens, timing.prefill_fed, 4),
        )
        if timing.grouping is not None:
            grouped, fallback = timing.grouping
            out.update(grouped_rounds=grouped, fallback_rounds=fallback, grouping_rate=_ratio(grouped, grouped + fallback, 4))
        if timing.draft is not None and timing.verify is not None and timing.wall > 0:
            other = timing.wall - timing.prefill - timing.draft - timing.verify
            parts = {"prefill": timing.prefill, "draft": timing.draft, "verify": timing.verify, "other": other}
            out["time_share"] = {k: round(v / timing.wall, 4) for k, v in parts.items()}
    return out


def _chosen(rows: Iterable[RowResult]) -> dict[str, Any]:
    """How many drafts rows verified per round (K: row-rounds), and the share of row-rounds where the
    policy verified fewer than the drafter proposed."""
    chosen: dict[int, int] = {}
    declined = total = 0
    for r in rows:
        for k, offered in zip(r.chosen_k, r.proposed_k):
            chosen[k] = chosen.get(k, 0) + 1
            declined += k < offered
            total += 1
    return {"chosen_k": {str(k): chosen[k] for k in sorted(chosen)}, "declined_share": _ratio(declined, total, 4)}


def _speedups(entry: dict[str, Any], base: dict[str, Any] | None) -> None:
    if base is None:
        return
    for key, field in (("speedup", "tokens_per_s"), ("decode_speedup", "decode_tokens_per_s")):
        if entry[field] is not None and base.get(field):
            entry[key] = round(entry[field] / base[field], 3)


def build_report(results: list[MethodResult], prompts: list[BenchPrompt]) -> list[dict[str, Any]]:
    """One entry per method: overall figures plus `groups` (per task group) when prompts have them."""
    groups = group_order(prompts)
    has_groups = groups != [None]
    entries: list[dict[str, Any]] = []
    for res in results:
        entry: dict[str, Any] = {
            "method": res.spec.name, "family": res.spec.family, "algorithm": res.spec.method,
            "batch_size": res.spec.batch_size, "scheduler": res.spec.scheduler, "error": res.error,
            "speculation": res.spec.speculation if res.spec.speculative else None,
            "drafter": res.spec.drafter if res.spec.speculative else None,
            "num_draft_tokens": res.spec.num_draft_tokens,
        }
        if res.error is None:
            total: Timing = reduce(operator.add, res.timings.values())
            entry.update(figures(res.rows, res.matches, res.labels, total))
            entry["divergences"] = [
                {"prompt_id": prompts[i].id, "group": prompts[i].group, "position": m.divergence,
                 "label": res.labels[i]}
                for i, m in enumerate(res.matches) if m is not None and not m.exact
            ]
            if has_groups:
                entry["groups"] = {}
                for g in groups:
                    idx = [i for i, p in enumerate(prompts) if p.group == g]
                    entry["groups"][g] = figures(
                        [res.rows[i] for i in idx], [res.matches[i] for i in idx], [res.labels[i] for i in idx],
                        res.timings.get(g),
                    )
        entries.append(entry)
    base = next((e for e in entries if e["method"] == BASELINE_SPEC.name and e["error"] is None), None)
    for entry in entries:
        if entry["error"] is None:
            _speedups(entry, base)
            for g, fig in entry.get("groups", {}).items():
                _speedups(fig, base["groups"][g] if base else None)
    return entries


# ---- text output --------------------------------------------------------------------------------
def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "%":
        return f"{100 * value:.1f}%"
    if kind == "x":
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(headers: list[str], rows: Iterable[list[str]]) -> str:
    """Fixed-width columns: the first left-aligned, numbers right-aligned."""
    rows = [headers] + [list(r) for r in rows]
    widths = [max(len(r[c]) for r in rows) for c in range(len(headers))]
    lines = []
    for n, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _share(entry: dict[str, Any], key: str) -> str:
    share = entry.get("time_share")
    return _fmt(share[key], "%") if share else "-"


def _exact(fig: dict[str, Any]) -> str:
    ok = fig["prompts"] - fig["errors"]
    return f"{fig['exact_matches']}/{ok}" if ok else "-"


def render_tables(entries: list[dict[str, Any]]) -> str:
    ok = [e for e in entries if e["error"] is None]
    speed = format_table(
        ["method", "tok/s", "decode tok/s", "speedup", "prefill s", "prefill tok/s", "padding", "decode s",
         "acc len", "acc rate", "prefill", "draft", "verify", "other"],
        ([e["method"], _fmt(e["tokens_per_s"]), _fmt(e["decode_tokens_per_s"]), _fmt(e["speedup"], "x"),
          _fmt(e["prefill_s"]), _fmt(e["prefill_tokens_per_s"]), _fmt(e["padding_share"], "%"), _fmt(e["decode_s"]),
          _fmt(e["mean_accepted_length"]), _fmt(e["acceptance_rate"], "%"),
          _share(e, "prefill"), _share(e, "draft"), _share(e, "verify"), _share(e, "other")] for e in ok),
    )
    quality = format_table(
        ["method", "exact", "exact %", "partial", "divergent", "fp ties", "sync err", "errors",
         "lat p50", "lat p99", "ttft p50", "ttft p99", "itl p50", "itl p99"],
        ([e["method"], _exact(e), _fmt(e["exact_match"], "%"), _fmt(e["partial_match"], "%"),
          str(e["divergent"]), str(e["fp_ties"]), str(e["sync_errors"]), str(e["errors"]),
          _fmt(e["latency_s"]["p50"]), _fmt(e["latency_s"]["p99"]), _fmt(e["ttft_s"]["p50"]), _fmt(e["ttft_s"]["p99"]),
          _fmt(e["itl_s"]["p50"]), _fmt(e["itl_s"]["p99"])] for e in ok),
    )
    parts = ["Speed (time shares of wall time; HF baselines have no phase breakdown)", speed, "",
             "Exactness vs plain batch-1 decoding; latency and time to first token in seconds since the run "
             "started; itl: seconds between a row's successive emissions (a round's tokens arrive together)", quality]
    grouped = [e for e in ok if "groups" in e]
    if grouped:
        rows = []
        for e in grouped:
            for g, fig in list(e["groups"].items()) + [(ALL, e)]:
                rows.append([e["method"], str(g), _fmt(fig["tokens_per_s"]), _fmt(fig["speedup"], "x"),
                             _fmt(fig["mean_accepted_length"]), _fmt(fig["acceptance_rate"], "%"), _exact(fig),
                             _fmt(fig["exact_match"], "%"), str(fig["fp_ties"]), str(fig["sync_errors"])])
        parts += ["", "Per task group", format_table(
            ["method", "group", "tok/s", "speedup", "acc len", "acc rate", "exact", "exact %", "fp ties", "sync err"],
            rows)]
    drafting = [e for e in ok if e["speculation"] is not None and not e["algorithm"].startswith("hf")]
    if drafting:
        parts += ["", "Chosen K: share of row-rounds verifying K drafts (K=0: a plain decoding step for that row); "
                  "declined: share where fewer were verified than the drafter proposed", _chosen_table(drafting)]
    pooled = [e for e in ok if e.get("grouping_rate") is not None]
    if pooled:
        parts += ["", "EXSPEC grouping (rounds served by a same-length group, no padding)", format_table(
            ["method", "grouped", "fallback", "grouping rate"],
            ([e["method"], str(e["grouped_rounds"]), str(e["fallback_rounds"]), _fmt(e["grouping_rate"], "%")]
             for e in pooled))]
    failed = [e for e in entries if e["error"] is not None]
    if failed:
        errors = format_table(["method", "error"], ([e["method"], e["error"]] for e in failed))
        parts += ["", "Methods that could not run", errors]
    return "\n".join(parts)


def _chosen_table(entries: list[dict[str, Any]]) -> str:
    top = max((int(k) for e in entries for k in e["chosen_k"]), default=0)
    rows = []
    for e in entries:
        for group, fig in [*e.get("groups", {}).items(), (ALL, e)]:
            total = sum(fig["chosen_k"].values())
            shares = [_fmt(fig["chosen_k"].get(str(k), 0) / total, "%") if total else "-" for k in range(top + 1)]
            rows.append([e["method"], str(group), *shares, _fmt(fig["declined_share"], "%")])
    return format_table(["method", "group", *(f"K={k}" for k in range(top + 1)), "declined"], rows)


def render_costs(costs: MeasuredCosts, rows: list[int], max_drafts: int) -> str:
    """The cost model as a user reads it: measured forward times, and the acceptance rate each K needs
    to beat plain decoding at each batch size (below it adaptive speculation verifies fewer drafts)."""
    lines = [f"Cost model ({costs.source}; online scale: verify {costs.verify_scale:.2f}, "
             f"draft {costs.draft_scale:.2f}, overhead {costs.overhead() * 1e3:.1f} ms/round)"]
    tokens = sorted({1, 2, max_drafts + 1, *costs.verify.tokens})
    lines.append(format_table(
        ["target forward (ms)", *(f"{n} tok/row" for n in tokens)],
        ([f"{r} rows", *(f"{costs.verify_time(r, n) * 1e3:.1f}" for n in tokens)] for r in rows)))
    if costs.draft is not None:
        fed = costs.draft.tokens  # a drafting step feeds 1 or 2 tokens per row; more: a catch-up (deferred prefill)
        lines += ["", format_table(
            ["drafter forward (ms)", *(f"{n} tok/row" for n in fed)],
            ([f"{r} rows", *(f"{costs.draft_time(r, n) * 1e3:.1f}" for n in fed)] for r in rows))]
    if costs.prompt is not None:  # a quantized drafter's deferred prefills
        lines += ["", format_table(["drafter prompt path (ms)", *(f"{n} tok" for n in costs.prompt.tokens)],
                                   [["1 row", *(f"{costs.prompt_time(n) * 1e3:.1f}" for n in costs.prompt.tokens)]])]
    lines += ["", "Break-even acceptance per draft: K drafts per row beat plain decoding only above it", format_table(
        ["batch", *(f"K={k}" for k in range(1, max_drafts + 1))],
        ([str(r), *(_even(costs, r, k) for k in range(1, max_drafts + 1))] for r in rows))]
    return "\n".join(lines)


def _even(costs: MeasuredCosts, rows: int, k: int) -> str:
    rate = break_even(costs, rows, k)
    return "never" if rate is None else _fmt(rate, "%")


# ---- files --------------------------------------------------------------------------------------
CSV_FIELDS = [
    "method", "group", "batch_size", "scheduler", "error", "prompts", "errors", "generated_tokens", "wall_s",
    "prefill_s", "decode_s", "tokens_per_s", "decode_tokens_per_s", "speedup", "decode_speedup",
    "prefill_tokens_per_s", "padding_share",
    "mean_accepted_length", "acceptance_rate", "share_prefill", "share_draft", "share_verify", "share_other",
    "latency_p50_s", "latency_p90_s", "latency_p99_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
    "itl_p50_s", "itl_p90_s", "itl_p99_s",
    "exact_matches", "exact_match", "partial_match", "divergent", "sync_errors", "fp_ties",
    "speculation", "drafter", "declined_share", "chosen_k",
]


def _flat(entry: dict[str, Any], fig: dict[str, Any], group: str) -> dict[str, Any]:
    row = {k: fig.get(k) for k in CSV_FIELDS if k in fig}
    row.update(method=entry["method"], group=group, error=entry["error"])
    row.update(batch_size=entry["batch_size"], scheduler=entry["scheduler"], speculation=entry["speculation"],
               drafter=entry["drafter"])
    row["chosen_k"] = " ".join(f"{k}:{n}" for k, n in fig.get("chosen_k", {}).items())
    for k, v in (fig.get("time_share") or {}).items():
        row[f"share_{k}"] = v
    for name in ("latency", "ttft", "itl"):
        for p, v in (fig.get(f"{name}_s") or {}).items():
            row[f"{name}_{p}_s"] = v
    return row


def write_csv(path: str | Path, entries: list[dict[str, Any]]) -> None:
    """One line per method overall (group `all`) and one per method and task group."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, restval="")
        writer.writeheader()
        for e in entries:
            writer.writerow(_flat(e, e, ALL))
            for g, fig in e.get("groups", {}).items():
                writer.writerow(_flat(e, fig, str(g)))

