"""Speculation policies replayed without timing noise: the real engine (`batchspec.bench.replay`)
decodes recorded plain outputs with scripted models that propose the drafter's recorded predictions,
and every forward it runs is billed at a measured cost table.

    PYTHONPATH=. python scripts/spec_replay.py --per-category 2 --max-new-tokens 48 \
        --batch-sizes 1,2,4,8 --data runs/replay.json
    # the same rounds billed at another machine's costs, as a bench run printed them (no models loaded)
    PYTHONPATH=. python scripts/spec_replay.py --batch-sizes 1,2,4,8 --data runs/replay.json \
        --costs-from docs/results/bench_epyc-avx512_b2-8.json

Why: a bench run of 12 SpecBench prompts takes minutes per method and moves by 5-15% between runs
on this shared machine, so two policies that differ by a few percent cannot be told apart by it;
a replay takes seconds and bills both for the same rounds. `batchspec bench` stays the measurement.

Recorded once per prompt (kept in --data): the target's plain greedy output, and one
teacher-forced drafter forward over prompt + output, giving the drafter's greedy token and its
probability at every output position (`batchspec.bench.replay` says what is exact and what is a
proxy).

Run as the engine runs: `build_engine` builds the engine each policy names (`ragged` with fixed K or
adaptive speculation, `ar` for plain decoding), all on the continuous scheduler (a finished row is
refilled at once), with the model drafter's own prefill at admission (fixed K) or lazy prefill and
catch-ups (adaptive), and chunked prefill as the engine does it by default (`--max-prefill-tokens`;
0: whole prompts). Every forward but the target's prefill (every policy pays the same for it) is
billed: drafter prefill, catch-ups, drafting steps and verifies. At batch 1 each task group runs on
its own, as `bench --suite specbench` runs it; at larger batches all prompts run together.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from batchspec.bench.replay import Record, policies, printed_costs, record, replay
from batchspec.config import ModelConfig, SpecConfig
from batchspec.costs import MeasuredCosts, measured_costs
from batchspec.llm import LLM
from batchspec.models import load_pair


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    p.add_argument("--draft-dtype", default="bfloat16")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt and catch-up tokens per step, as the engine's option (default: the engine's; 0: whole prompts)")
    p.add_argument("--data", help="JSON of recorded outputs: read if it exists, else recorded and written here")
    p.add_argument("--costs-from", help="bill rounds at the cost tables printed in this `bench --costs --json` "
                   "report (another machine's, say) instead of this machine's")
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    path = Path(args.data) if args.data else None
    recorded = path is not None and path.is_file()
    models = None
    if not recorded or not args.costs_from:
        config = ModelConfig(draft_dtype=args.draft_dtype)
        models = load_pair(config)
    if recorded:
        records = [Record(**r) for r in json.loads(path.read_text())]
    else:
        llm = LLM(config, spec=SpecConfig(method="ar", batch_size=4), models=models)
        records = record(llm, args.per_category, args.max_new_tokens)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([r.__dict__ for r in records]))
    groups = list(dict.fromkeys(r.group for r in records))
    print(f"{len(records)} prompts ({', '.join(groups)}), {sum(len(r.output) for r in records)} output tokens; "
          "simulated decode tokens/s (drafter prefill included, target prefill not) and ratio to ar")
    printed = printed_costs(Path(args.costs_from)) if args.costs_from else None
    for batch in batches:
        def fresh() -> MeasuredCosts:
            if printed is not None:  # a fresh copy: the online rescaling is per run
                return MeasuredCosts(printed.verify, printed.draft, printed.source)
            return measured_costs(models.target, models.draft, batch, args.num_draft_tokens)

        parts = {g: [r for r in records if r.group == g] for g in groups} if batch == 1 else {"all": records}
        print(f"\nbatch {batch} ({'each group on its own' if batch == 1 else 'all prompts together'})")
        header = ["policy", *parts] + (["all"] if batch == 1 else [])
        print("  ".join(f"{h:>14}" for h in header) + f"  K=0/.../{args.num_draft_tokens} share of row-rounds")
        base: dict[str, float] = {}
        for name, policy in policies(args.num_draft_tokens).items():
            spec = replace(policy, batch_size=batch, max_prefill_tokens=args.max_prefill_tokens)
            cells, tokens, seconds, chosen = [], 0, 0.0, []
            for label, recs in parts.items():
                run = replay(recs, spec, fresh(), args.max_new_tokens, costs=fresh())
                rate = run.tokens / run.seconds
                base.setdefault(label, rate)
                cells.append(f"{rate:6.2f} {rate / base[label]:5.2f}x")
                tokens, seconds, chosen = tokens + run.tokens, seconds + run.seconds, chosen + run.chosen
            if batch == 1:
                base.setdefault("all*", tokens / seconds)
                cells.append(f"{tokens / seconds:6.2f} {tokens / seconds / base['all*']:5.2f}x")
            shares = "/".join(f"{sum(c == k for c in chosen) / max(len(chosen), 1):.0%}".rstrip("%")
                              for k in range(args.num_draft_tokens + 1))
            print("  ".join(f"{c:>14}" for c in [name, *cells]) + f"  {shares}%")


if __name__ == "__main__":
    main()
