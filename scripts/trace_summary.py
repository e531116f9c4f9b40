"""Where the rows waited: a step trace (`--trace FILE`, docs/cli.md) summarised per method.

    python scripts/trace_summary.py runs/trace.jsonl

A row waits for every piece of the step it is in, so per method (all repeats together) this prints
the longest step; that step's parts: its prefill pieces (prompt chunks, each a forward of its own)
and the rest (drafter catch-ups and the round); the longest rest of any step against the slowest
round, which says whether anything besides prefill stalled the rows; and the most prefill pieces
one step ran. Issue 29's stall target reads: no step's rest above twice the slowest plain round.
Then what the drafter's catch-ups fed and took, and what a token of a row's own catch-ups (deferred
prefills and long lags, one row a forward) cost.

A second table prices the plain rounds (those that verified no draft) by how many rows they ran:
issue 29's "K = 0 costs what `ar` costs" read round for round at equal row counts, without the
prefill and catch-ups that share a run's decoding seconds. A method whose declined rounds still pay
for something (a lookup, the policy's weighing of its proposals) shows it here against `ar`.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from batchspec.bench.report import format_table


def summarise(lines: list[str]) -> list[dict]:
    """One dict per method, in the order the trace first names them."""
    steps: dict[str, dict[tuple[int, int], dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    catch_ups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        method = record.get("method", "-")
        if record["piece"] == "catch_up":  # a drafter's: shared by the rows it lists, or one row's own
            fed = catch_ups[method]
            fed["tokens"] += sum(record.get("tokens", []))
            fed["s"] += record["s"]
            if not record.get("shared", False):
                fed["own_tokens"] += sum(record.get("tokens", []))
                fed["own_s"] += record["s"]
        step = steps[method][record.get("repeat", 0), record["step"]]
        part = "prefill" if record["piece"] == "prefill" else "rest"
        step[part] += record["s"]
        step[f"{part}_pieces"] += 1
        if record["piece"] == "round":
            step["round"] = max(step["round"], record["s"])
    out = []
    for method, by_step in steps.items():
        parts = list(by_step.values())
        longest = max(parts, key=lambda p: p["prefill"] + p["rest"])
        out.append({
            "method": method,
            "steps": len(parts),
            "longest_step_s": longest["prefill"] + longest["rest"],
            "its_prefill_s": longest["prefill"],
            "its_rest_s": longest["rest"],
            "longest_rest_s": max(p["rest"] for p in parts),
            "slowest_round_s": max(p["round"] for p in parts),
            "most_prefill_pieces": int(max(p["prefill_pieces"] for p in parts)),
            "catch_up_tokens": int(catch_ups[method]["tokens"]),
            "catch_up_s": catch_ups[method]["s"],
            "own_catch_up_ms_per_token": (1e3 * catch_ups[method]["own_s"] / catch_ups[method]["own_tokens"]
                                          if catch_ups[method]["own_tokens"] else None),
        })
    return out


def plain_rounds(lines: list[str]) -> list[dict]:
    """Per method and row count (in the order first seen, row counts ascending): how many rounds
    verified no draft and their mean milliseconds."""
    seconds: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        if record["piece"] == "round" and record.get("verify_width", 0) == 0:
            seconds[record.get("method", "-")][len(record["requests"])].append(record["s"])
    return [{"method": method, "rows": rows, "rounds": len(s), "mean_ms": 1e3 * sum(s) / len(s)}
            for method, by_rows in seconds.items() for rows, s in sorted(by_rows.items())]


def render(rows: list[dict]) -> str:
    headers = ["method", "steps", "longest step s", "its prefill s", "its rest s", "longest rest s",
               "slowest round s", "prefill pieces/step", "catch-up tokens", "catch-up s", "own catch-ups ms/token"]
    keys = ("method", "steps", "longest_step_s", "its_prefill_s", "its_rest_s", "longest_rest_s",
            "slowest_round_s", "most_prefill_pieces", "catch_up_tokens", "catch_up_s", "own_catch_up_ms_per_token")
    return format_table(headers, [[f"{r[k]:.3f}" if isinstance(r[k], float) else "-" if r[k] is None else str(r[k])
                                   for k in keys] for r in rows])


def render_plain(rows: list[dict]) -> str:
    return format_table(["method", "rows", "plain rounds", "mean ms"],
                        [[r["method"], str(r["rows"]), str(r["rounds"]), f"{r['mean_ms']:.1f}"] for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a JSONL step trace written by --trace")
    args = parser.parse_args()
    try:
        lines = args.trace.read_text().splitlines()
    except OSError as exc:
        parser.exit(2, f"trace_summary: cannot read {args.trace}: {exc.strerror}\n")
    try:
        rows, plain = summarise(lines), plain_rounds(lines)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        parser.exit(2, f"trace_summary: {args.trace} is not a step trace ({type(exc).__name__}: {exc})\n")
    print(render(rows))
    print("\nPlain rounds (no draft verified) by the rows they ran")
    print(render_plain(plain))


if __name__ == "__main__":
    main()
