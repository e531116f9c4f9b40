"""Speculation policies replayed without timing noise: the real policies (`batchspec.speculation`)
steer a simulated engine over recorded plain outputs and the drafter's recorded predictions, and
every round is billed at the measured cost table.

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
probability at every output position. A draft chain that has matched the output so far saw exactly
that context, so which drafts are accepted is exact (up to the drafter's rounding in one long
forward versus step by step); after a rejected draft the drafter's confidences are proxies (those
of the teacher-forced positions), which only matters for when steering stops a round that already
lost its remaining drafts.

Simulated as the engine runs it: continuous batching of B rows (a finished row is refilled at
once), the drafter's lazy prefill (adaptive) or prefill at admission (fixed), catch-ups as
`ModelDrafter` does them (lags over SHARED_CATCH_UP tokens in a forward of that row alone, shorter
ones in one forward shared by all rows), draft steps (the first feeding two tokens per row) and one
rectangular verify. The target's prefill is left out (every policy pays the same for it); the
drafter's prefill is in. At batch 1 each task group runs on its own, as `bench --suite specbench`
runs it; at larger batches all prompts run together.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.costs import MeasuredCosts, TimingTable, measured_costs
from batchspec.drafters import SHARED_CATCH_UP, Draft
from batchspec.llm import LLM
from batchspec.models import load_pair
from batchspec.sequence import Sequence
from batchspec.speculation import AdaptiveSpeculation, FixedSpeculation, RoundTimes, Speculation


@dataclass
class Record:
    """One prompt: its plain output and, per output position t, the drafter's greedy prediction of
    output[t] from prompt + output[:t] and that prediction's probability."""

    group: str
    prompt: list[int]
    output: list[int]
    draft_top: list[int]
    draft_p: list[float]


def record(llm: LLM, per_category: int, max_new_tokens: int) -> list[Record]:
    """Plain outputs of the first `per_category` SpecBench prompts of every group, and the
    drafter's teacher-forced predictions along them."""
    from batchspec.bench.specbench import SPECBENCH_FILE, encode_prompts, select
    from batchspec.kv import forward_all_positions

    prompts = select(encode_prompts(SPECBENCH_FILE, llm.encode)[0], per_group=per_category)
    outputs = llm.generate([list(p.token_ids) for p in prompts], SamplingParams(max_new_tokens=max_new_tokens))
    records = []
    for p, out in zip(prompts, outputs):
        ids = list(p.token_ids) + out.token_ids
        probs = torch.softmax(forward_all_positions(llm.models.draft, ids[:-1], keep=len(out.token_ids)), dim=-1)
        top_p, top = probs.max(dim=-1)
        records.append(Record(p.group, list(p.token_ids), out.token_ids, top.tolist(), top_p.tolist()))
    return records


def printed_costs(path: Path) -> MeasuredCosts:
    """The target's and the drafter's timing tables as `batchspec bench --costs` printed them into
    its JSON report (milliseconds; a header of tokens per row, a line per batch size)."""
    tables = []
    lines = json.loads(path.read_text())["costs"].splitlines()
    for title in ("target forward (ms)", "drafter forward (ms)"):
        start = next(i for i, line in enumerate(lines) if line.startswith(title))
        tokens = [int(cell) for cell in lines[start].split()[3::2]]
        rows, seconds = [], []
        for line in lines[start + 2 :]:
            if not line.strip():
                break
            cells = line.split()
            rows.append(int(cells[0]))
            seconds.append([float(ms) / 1e3 for ms in cells[2:]])
        tables.append(TimingTable(rows, tokens, seconds))
    return MeasuredCosts(*tables, source=str(path))


class Replay:
    """One simulated run of a policy over some records at a batch size, billed by `truth`."""

    def __init__(self, records: list[Record], batch: int, policy: Speculation, truth: MeasuredCosts,
                 prefill: str, max_new_tokens: int) -> None:
        """prefill: when the drafter prefills a prompt: `admission`, `lazy` (when first drafted
        for) or `never` (no drafter: plain decoding). max_new_tokens: the budget the outputs were
        recorded with; a shorter output ended at its last token, a stop token, which is all the
        policy is told (it must not know in advance where a row stops)."""
        self.records, self.batch, self.policy, self.truth, self.prefill = records, batch, policy, truth, prefill
        self.max_new_tokens = max_new_tokens
        self.time = {"draft_prefill": 0.0, "catch_up": 0.0, "draft": 0.0, "verify": 0.0}
        self.chosen: list[int] = []
        self.tokens = 0

    def run(self) -> Replay:
        waiting = list(enumerate(self.records))
        running: list[tuple[Sequence, Record]] = []
        have: list[int] = []  # tokens of each row the drafter validly holds
        while waiting or running:
            while waiting and len(running) < self.batch:
                i, rec = waiting.pop(0)
                stop = frozenset(rec.output[-1:]) if len(rec.output) < self.max_new_tokens else frozenset()
                seq = Sequence(i, rec.prompt, SamplingParams(max_new_tokens=self.max_new_tokens), stop)
                seq.extend(rec.output[:1])  # the first token comes from the target's prefill
                running.append((seq, rec))
                have.append(len(rec.prompt) if self.prefill == "admission" else 0)
                if self.prefill == "admission":
                    self.time["draft_prefill"] += self.truth.draft_time(1, len(rec.prompt))
            self._round(running, have)
            keep = [not s.finished for s, _ in running]
            self.policy.forget([s for (s, _), k in zip(running, keep) if not k])
            running = [r for r, k in zip(running, keep) if k]
            have = [h for h, k in zip(have, keep) if k]
        return self

    def _round(self, running: list[tuple[Sequence, Record]], have: list[int]) -> None:
        seqs = [s for s, _ in running]
        rows = len(seqs)
        valid = [min(h, s.length - 2) for h, s in zip(have, seqs)]  # what ModelDrafter._span counts as held
        lags = [s.length - 2 - v for s, v in zip(seqs, valid)]
        plan = self.policy.plan(seqs, lags if self.policy.weighs_backlog else None)
        steer = plan.steer
        steps, draft_s, catch_up = 0, 0.0, 0.0
        if plan.steps > 0 and (steer is None or steer.proceed(0)):
            joined = steer.drafting().tolist() if steer is not None else [True] * rows
            long = [n for n, j in zip(lags, joined) if j and n > SHARED_CATCH_UP]
            short = [n for n, j in zip(lags, joined) if j and 0 < n <= SHARED_CATCH_UP]
            catch_up = sum(self.truth.draft_time(1, n) for n in long) + (self.truth.draft_time(rows, max(short)) if short else 0.0)
            for step in range(plan.steps):
                draft_s += self.truth.draft_time(rows, 2 if step == 0 else 1)
                p = [rec.draft_p[min(s.length - len(rec.prompt) + step, len(rec.output) - 1)] for s, rec in running]
                steps = step + 1
                if steer is not None:
                    chance = torch.tensor(p).clamp(1e-6, 1 - 1e-6)
                    steer.observed(step, torch.stack([chance.log(), (1 - chance).log()], dim=1),
                                   torch.zeros(rows, dtype=torch.long), None)
                    if step + 1 < plan.steps and not steer.proceed(step + 1):
                        break
            lengths = torch.tensor([steps if j else 0 for j in joined])
            proposal = Draft(torch.zeros(rows, steps, dtype=torch.long), torch.zeros(rows, steps, 2),
                             None if all(joined) else lengths)
            draft = self.policy.settle(plan, proposal)
            for b, (s, j) in enumerate(zip(seqs, joined)):
                have[b] = s.length + steps - 1 if j else valid[b]
        else:
            draft = Draft(torch.zeros(rows, 0, dtype=torch.long), None)
            have[:] = [min(h, s.length - 1) for h, s in zip(have, seqs)]
        verify_s = self.truth.verify_time(rows, draft.width + 1)
        count = []
        for (s, rec), n in zip(running, draft.row_lengths().tolist()):
            g = len(s.generated)
            hits = 0
            while hits < n and g + hits < len(rec.output) and rec.draft_top[g + hits] == rec.output[g + hits]:
                hits += 1
            count.append(s.extend(rec.output[g : g + hits + 1]))
            self.chosen.append(n)
        self.tokens += sum(count)
        self.time["catch_up"] += catch_up
        self.time["draft"] += draft_s
        self.time["verify"] += verify_s
        self.policy.observe(seqs, plan, draft, torch.tensor(count), RoundTimes(draft_s, verify_s, 0.0, catch_up))

    @property
    def seconds(self) -> float:
        return sum(self.time.values())


def policies(k_max: int) -> dict[str, Callable[[MeasuredCosts], tuple[Speculation, str]]]:
    """Name -> (policy on these costs, when the drafter prefills: see `Replay`)."""
    out: dict[str, Callable[[MeasuredCosts], tuple[Speculation, str]]] = {
        "ar": lambda costs: (FixedSpeculation(0), "never")}
    for k in range(1, k_max + 1):
        out[f"K={k}"] = lambda costs, k=k: (FixedSpeculation(k), "admission")
    out["adaptive"] = lambda costs: (AdaptiveSpeculation(k_max, costs), "lazy")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    p.add_argument("--draft-dtype", default="bfloat16")
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
        for name, make in policies(args.num_draft_tokens).items():
            cells, tokens, seconds, chosen = [], 0, 0.0, []
            for label, recs in parts.items():
                policy, prefill = make(fresh())
                replay = Replay(recs, batch, policy, fresh(), prefill, args.max_new_tokens).run()
                rate = replay.tokens / replay.seconds
                base.setdefault(label, rate)
                cells.append(f"{rate:6.2f} {rate / base[label]:5.2f}x")
                tokens, seconds, chosen = tokens + replay.tokens, seconds + replay.seconds, chosen + replay.chosen
            if batch == 1:
                base.setdefault("all*", tokens / seconds)
                cells.append(f"{tokens / seconds:6.2f} {tokens / seconds / base['all*']:5.2f}x")
            shares = "/".join(f"{sum(c == k for c in chosen) / max(len(chosen), 1):.0%}".rstrip("%")
                              for k in range(args.num_draft_tokens + 1))
            print("  ".join(f"{c:>14}" for c in [name, *cells]) + f"  {shares}%")


if __name__ == "__main__":
    main()
