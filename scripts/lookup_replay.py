"""How often prompt lookup's drafts would be accepted, by the length of the suffix that matched:
a replay of `batchspec.drafters.NgramIndex` over plain greedy outputs (no timing, no speculation).

    PYTHONPATH=. python scripts/lookup_replay.py --per-category 6 --max-new-tokens 48

Decodes SpecBench prompts plainly with the bundled target (or reads --outputs saved by an earlier
run), then replays greedy verification round by round: at each round the index proposes up to K
tokens after the longest matching suffix of ngram_min..ngram_max tokens, the drafts are accepted
while they equal the plain output, and the context grows by the accepted drafts plus one. It
prints the acceptance of each draft position by matched length (what `match_confidence` encodes)
and, per task group and (ngram_min, K), the drafts' acceptance and the tokens per round.
README ("Drafters") quotes a run.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from batchspec.config import SamplingParams
from batchspec.drafters import NgramIndex
from batchspec.sequence import Sequence

POSITIONS = 5


def decode(per_category: int, max_new_tokens: int) -> list[dict]:
    """Plain greedy outputs of the first `per_category` SpecBench prompts of every group."""
    from batchspec.bench.specbench import SPECBENCH_FILE, encode_prompts, select
    from batchspec.config import SpecConfig
    from batchspec.llm import LLM

    llm = LLM(spec=SpecConfig(method="ar", batch_size=1))
    prompts = select(encode_prompts(SPECBENCH_FILE, llm.encode)[0], per_group=per_category)
    outputs = llm.generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens=max_new_tokens))
    return [{"group": p.group, "prompt": list(p.token_ids), "output": o.token_ids} for p, o in zip(prompts, outputs)]


def replay(record: dict, min_n: int, max_n: int, k: int, by_match: dict) -> tuple[int, int, int, int]:
    """(rounds, tokens, drafts proposed, drafts accepted) of greedy prompt-lookup decoding of one
    record; by_match[(n, j)] gathers [accepted, judged] of draft j after an n-token match."""
    seq = Sequence(0, record["prompt"], SamplingParams(max_new_tokens=len(record["output"])), frozenset())
    index, output = NgramIndex(min_n, max_n), record["output"]
    rounds = proposed = accepted = 0
    while len(seq.generated) < len(output):
        done = len(seq.generated)
        matched, drafts = index.lookup(seq, min(k, len(output) - done - 1))
        hits = 0
        while hits < len(drafts) and drafts[hits] == output[done + hits]:
            hits += 1
        for j in range(min(hits + 1, len(drafts))):  # drafts after the first rejection are never judged
            by_match[matched, j][0] += j < hits
            by_match[matched, j][1] += 1
        seq.generated.extend(output[done : done + hits + 1])
        rounds, proposed, accepted = rounds + 1, proposed + len(drafts), accepted + hits
    return rounds, len(output), proposed, accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-category", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--outputs", help="JSON of plain outputs: read if it exists, else decoded and written here")
    p.add_argument("--max-n", type=int, default=8, help="longest suffix for the by-length table")
    args = p.parse_args()
    path = Path(args.outputs) if args.outputs else None
    if path is not None and path.is_file():
        records = json.loads(path.read_text())
    else:
        records = decode(args.per_category, args.max_new_tokens)
        if path is not None:
            path.write_text(json.dumps(records))

    by_match: dict = defaultdict(lambda: [0, 0])
    for record in records:
        replay(record, 1, args.max_n, POSITIONS, by_match)
    print(f"acceptance of draft j after an n-token match (ngram 1..{args.max_n}, K={POSITIONS}), accepted/judged")
    for n in range(1, args.max_n + 1):
        cells = [by_match[n, j] for j in range(POSITIONS)]
        print(f"n={n}: " + "  ".join(f"j{j} {a:>3}/{t:<3} {a / t if t else float('nan'):4.0%}" for j, (a, t) in enumerate(cells)))

    groups = sorted({r["group"] for r in records})
    print("\nper group: drafts accepted / proposed, tokens per round")
    for min_n in (1, 2, 3, 5):
        for k in (3, 5):
            line = []
            for group in groups:
                totals = [0, 0, 0, 0]
                for record in (r for r in records if r["group"] == group):
                    totals = [a + b for a, b in zip(totals, replay(record, min_n, 5, k, defaultdict(lambda: [0, 0])))]
                rounds, tokens, proposed, accepted = totals
                line.append(f"{group[:8]} {accepted / max(proposed, 1):4.0%} {tokens / rounds:.2f}")
            print(f"ngram {min_n}..5 K={k}: " + " | ".join(line))


if __name__ == "__main__":
    main()
