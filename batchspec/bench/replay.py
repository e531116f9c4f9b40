"""Speculation policies replayed without timing noise: the real engine decodes recorded outputs with
scripted models, and every forward it runs is billed at a cost table.

A bench run moves by 5-15% between runs on a shared machine, so two policies a few percent apart
cannot be told apart by it; a replay is deterministic, takes seconds, and bills both for the same
rounds. `batchspec bench` stays the measurement.

What is recorded (`Record`, `record`): per prompt, the target's plain greedy output, and one
teacher-forced drafter forward over prompt + output, giving the drafter's greedy token and its
probability at every output position.

What runs: `batchspec.build.build_engine` builds the real engine (scheduler, rows, `ModelDrafter`
with its lazy prefill and catch-ups, speculation policy) on two `ScriptedModel`s kept in
`ScriptedLayout`s. A scripted layout is a ragged layout whose K/V of a token is the token id itself:
a forward writes the fed ids at the row's cursor, as K/V would be written, and answers each query
from what the query sees (its row's ids up to its position): the record whose prompt begins them
and how far into the output the query stands. The target predicts the recorded output token there
(so acceptance is exact), the drafter its recorded prediction with its recorded probability. A draft
chain that has matched the output so far saw exactly the recorded context, so which drafts are
accepted is exact; after a rejected draft the drafter's tokens and confidences are those of the
teacher-forced positions, proxies that only matter for when steering stops a round that already lost
its remaining drafts. Each forward advances a simulated clock by the cost table's price of its shape
(rows x tokens), and the layouts are the engine's clock, so the engine's measured phase times, the
drafter's catch-up seconds and the policy's `observe` all see those prices. The target's prefill is
left out (every policy pays the same for it); the drafter's prefill is in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from ..build import build_engine
from ..config import SamplingParams, SpecConfig
from ..costs import Costs, MeasuredCosts, TimingTable
from ..engine import Engine
from ..kv.attention import EXACT_ATTENTION
from ..layouts import RaggedLayout
from ..trace import NullTrace

if TYPE_CHECKING:
    from ..llm import LLM


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
    from ..kv import forward_all_positions
    from .specbench import SPECBENCH_FILE, encode_prompts, select

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


class Script:
    """The records in a compact vocabulary (ids 0, 1, ... for the tokens they use, so logits stay
    small whatever the real vocabulary), and which record a row of token ids belongs to.

    Records are told apart by their prompts, so no prompt may begin another. `max_new_tokens`: the
    budget the outputs were recorded with; a shorter output ended at its last token, a stop token,
    which is all the engine is told (the policy must not know in advance where a row stops)."""

    def __init__(self, records: list[Record], max_new_tokens: int) -> None:
        self.real = sorted({t for r in records for t in (*r.prompt, *r.output, *r.draft_top)})
        compact = {t: i for i, t in enumerate(self.real)}
        self.prompts = [[compact[t] for t in r.prompt] for r in records]
        self.outputs = [[compact[t] for t in r.output] for r in records]
        self.draft_top = [[compact[t] for t in r.draft_top] for r in records]
        self.draft_p = [list(r.draft_p) for r in records]
        self.max_new_tokens = max_new_tokens
        self._check(records)
        self.by_prompt = {tuple(p): i for i, p in enumerate(self.prompts)}
        self.prompt_lengths = sorted({len(p) for p in self.prompts})
        # Logits put probability p on the predicted token and spread the rest evenly: the token is
        # the argmax only if p beats each other token's share, (1 - p) / (vocab - 1).
        least = min((p for ps in self.draft_p for p in ps), default=1.0)
        self.vocab = max(len(self.real), math.floor(1 / least) + 2)

    def _check(self, records: list[Record]) -> None:
        for i, (r, prompt, out) in enumerate(zip(records, self.prompts, self.outputs)):
            if not prompt or not out or len(out) > self.max_new_tokens:
                raise ValueError(f"record {i}: needs a prompt and 1 to {self.max_new_tokens} output tokens")
            if not len(r.draft_top) == len(r.draft_p) == len(out):
                raise ValueError(f"record {i}: one drafter prediction per output token is needed")
            if not all(0 < p <= 1 for p in r.draft_p):
                raise ValueError(f"record {i}: drafter probabilities must lie in (0, 1]")
            if len(out) < self.max_new_tokens and out[-1] in out[:-1]:
                raise ValueError(f"record {i}: its stop token (its last) occurs earlier in its output")
            for j, other in enumerate(self.prompts):
                if j != i and other[: len(prompt)] == prompt:
                    raise ValueError(f"records {i} and {j}: a prompt begins another, rows could not be told apart")

    def params(self, i: int) -> SamplingParams:
        """Record i's request: the recorded budget, and its last token as stop token if it stopped early."""
        out = self.outputs[i]
        stop = (out[-1],) if len(out) < self.max_new_tokens else ()
        return SamplingParams(max_new_tokens=self.max_new_tokens, stop_token_ids=stop)

    def find(self, ids: list[int]) -> int | None:
        """The record whose prompt begins `ids` (None: no prompt is complete in them yet)."""
        for n in self.prompt_lengths:
            if n > len(ids):
                break
            found = self.by_prompt.get(tuple(ids[:n]))
            if found is not None:
                return found
        return None

    def decode(self, ids: list[int]) -> list[int]:
        """Compact ids back to the records' own."""
        return [self.real[t] for t in ids]


class SimulatedClock:
    """Seconds billed so far: the replay's only clock."""

    def __init__(self) -> None:
        self.now = 0.0


class ScriptedModel(torch.nn.Module):
    """A model that predicts, at output position t of record r, `tokens[r][t]` with probability
    `probs[r][t]` (the last position's beyond the record), and whose forwards cost `price(rows,
    tokens)` seconds on `clock` (`prefill_price` for a prefill). It carries what the library reads
    of a model (a config, an embedding table giving its vocabulary, a parameter giving dtype and
    device); only a `ScriptedLayout` runs it."""

    def __init__(self, script: Script, tokens: list[list[int]], probs: list[list[float]], clock: SimulatedClock,
                 price: Callable[[int, int], float], prefill_price: Callable[[int, int], float]) -> None:
        super().__init__()
        self.script, self.tokens, self.probs, self.clock = script, tokens, probs, clock
        self.price, self.prefill_price = price, prefill_price
        self.config = PretrainedConfig(num_hidden_layers=1)
        self.config._attn_implementation = EXACT_ATTENTION  # what a layout would switch it to; none runs
        self.embed = torch.nn.Embedding(script.vocab, 1)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def bill(self, rows: int, tokens: int, prefill: bool) -> None:
        self.clock.now += (self.prefill_price if prefill else self.price)(rows, tokens)

    def logits(self, record: int | None, wanted: list[int]) -> torch.Tensor:
        """[len(wanted), vocab]: the predictions of output tokens `wanted` of `record`; uniform for a
        negative index (a query inside the prompt) or no record (no prompt complete yet): catch-up
        and prefill queries, whose logits nobody reads."""
        out = torch.zeros(len(wanted), self.script.vocab)
        if record is None:
            return out
        tokens, probs = self.tokens[record], self.probs[record]
        for i, t in enumerate(wanted):
            if t < 0:
                continue
            t = min(t, len(tokens) - 1)
            p = probs[t]
            rest = max((1 - p) / (self.script.vocab - 1), 1e-30)  # a certain prediction: the rest ~0, finite
            out[i] = math.log(rest)
            out[i, tokens[t]] = math.log(p)
        return out


class ScriptedLayout(RaggedLayout):
    """Per-row cursors exactly as `RaggedLayout` keeps them (commit, drop, stage, catch-up feeds are
    its own code); the K/V a forward writes is the token ids, and the logits are its model's
    predictions for what each query sees. Every forward is billed on the model's clock, which is
    this layout's clock."""

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        if not isinstance(model, ScriptedModel):
            raise TypeError("a scripted layout runs a ScriptedModel")
        super().__init__(model, max_rows, capacity)
        self.scripted = model
        # Each slot holds its token's id, in the store's K/V shape [layers, k/v, rows, heads, slots,
        # dim], so that the store's own row moves (`drop`) carry the ids along.
        self.store.data = torch.zeros((1, 1, max_rows, 1, capacity, 1), dtype=torch.long)
        self._prefilling = False

    def clock(self) -> float:
        return self.scripted.clock.now

    @contextmanager
    def _prefill_forwards(self) -> Iterator[None]:
        """The forwards run inside are prefills (billed at the model's prefill price)."""
        self._prefilling = True
        try:
            yield
        finally:
            self._prefilling = False

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        with self._prefill_forwards():
            return super().prefill(prompts)

    def stage(self, tokens: list[int]) -> torch.Tensor:
        with self._prefill_forwards():
            return super().stage(tokens)

    def _run(self, rows: slice, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
             write_start: int | torch.Tensor, logits_to_keep: int | torch.Tensor, kv_start: int = 0) -> torch.Tensor:
        """Write the fed ids at their slots and predict from each kept query's row up to its position
        (a ragged row starts at slot 0 and a query sees the slots up to its own)."""
        b, n = tokens.shape
        self.store.attend(rows, write_start, kv_start + visible.shape[-1], kv_start)  # refuses overrunning rows
        self.scripted.bill(b, n, self._prefilling)
        self.last_positions, self.last_visible = positions, visible
        ids = self.store.data[0, 0, rows, 0, :, 0]  # [b, capacity], a view
        slots = torch.as_tensor(write_start).reshape(-1, 1) + torch.arange(n)  # [1 or b, n]
        ids.scatter_(1, slots.expand(b, n), tokens)
        kept = n if int(logits_to_keep) == 0 else int(logits_to_keep)
        script = self.scripted.script
        out = []
        for row, pos in zip(ids, positions[:, n - kept :].tolist()):
            seen = row[: pos[-1] + 1].tolist()
            found = script.find(seen)
            start = len(script.prompts[found]) if found is not None else 0
            out.append(self.scripted.logits(found, [p + 1 - start for p in pos]))  # the output index each predicts
        return torch.stack(out)


def policies(k_max: int) -> dict[str, SpecConfig]:
    """Name -> the engine configuration that runs it (its batch size set per replay). Every policy
    refills a finished row at once (the continuous scheduler); fixed K prefills the drafter at
    admission, adaptive when it first drafts for a row, as `build` sets them up."""
    out = {"ar": SpecConfig(method="ar", scheduler="continuous")}
    for k in range(1, k_max + 1):
        out[f"K={k}"] = SpecConfig(method="ragged", num_draft_tokens=k, speculation="fixed")
    out["adaptive"] = SpecConfig(method="ragged", num_draft_tokens=k_max, speculation="adaptive")
    return out


@dataclass
class Replayed:
    """What a replay decoded and what it was billed."""

    outputs: list[list[int]]  # per record, in the records' own token ids
    seconds: float  # billed: every forward but the target's prefill
    tokens: int  # emitted by rounds (each row's first token comes from the target's prefill)
    chosen: list[int]  # drafts verified, per row and round
    engine: Engine  # its stats, for tests and reports


def replay(records: list[Record], spec: SpecConfig, truth: Costs, max_new_tokens: int,
           costs: Costs | None = None, trace: NullTrace | None = None) -> Replayed:
    """Decode `records` with the engine `spec` configures, its forwards billed at `truth`'s prices.
    `costs`: the cost model an adaptive policy decides on (it learns from the billed rounds, so give
    each replay its own); `trace`: records every step's pieces, as `build_engine` takes it."""
    script = Script(records, max_new_tokens)
    clock = SimulatedClock()
    target = ScriptedModel(script, script.outputs, [[1.0] * len(o) for o in script.outputs], clock,
                           truth.verify_time, lambda rows, tokens: 0.0)
    drafter = ScriptedModel(script, script.draft_top, script.draft_p, clock, truth.draft_time, truth.draft_time)
    engine = build_engine(target, spec, draft_model=drafter, costs=costs, layout=ScriptedLayout, trace=trace)
    done = engine.generate(script.prompts, [script.params(i) for i in range(len(records))])
    return Replayed([script.decode(s.generated) for s in done], clock.now,
                    sum(len(s.generated) - 1 for s in done), [k for s in done for k in s.chosen_k], engine)
