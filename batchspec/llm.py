"""The Python API, shaped like the engines users know:

    llm = LLM(spec=SpecConfig(method="ragged", num_draft_tokens=5, batch_size=4))
    outputs = llm.generate(["Write a haiku about caches."], SamplingParams(max_new_tokens=64))

A batch loses nothing: every prompt comes back, in input order, with either an output or an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence as Seq
from dataclasses import asdict, dataclass, field, fields

import torch

from .config import BatchspecError, SamplingParams, SpecConfig
from .drafters import Drafter
from .engine import Engine, EngineStats, validate_prompt
from .exspec import ExspecEngine
from .forensics import broken
from .models import ModelPair, encode_prompt, eos_token_ids, load_pair
from .sequence import Sequence


@dataclass
class RequestOutput:
    """One prompt's result. `error` is set (and `token_ids` empty) when the prompt was refused."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    time_to_first_token: float | None = None
    latency: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


Prompt = str | list[int]


def build_engine(
    target: torch.nn.Module,
    spec: SpecConfig,
    stop_ids: Iterable[int] = (),
    draft_model: torch.nn.Module | None = None,
    drafter: Drafter | None = None,
    seed: int | None = None,
) -> Engine:
    """The engine for `spec.method`: EXSPEC schedules from a pool; the deliberately wrong methods
    (opt-in, for audits) come from forensics.broken; everything else is the plain round loop."""
    engine_class = ExspecEngine if spec.method == "exspec" else broken.ENGINES.get(spec.method, Engine)
    return engine_class(target, spec, stop_ids, draft_model=draft_model, drafter=drafter, seed=seed)


class LLM:
    """A target (and drafter) plus a decoding method. Prompts may be text or token ids."""

    def __init__(
        self,
        target: str | None = None,
        draft: str | None = None,
        spec: SpecConfig | None = None,
        dtype: str = "float32",
        draft_dtype: str | None = None,
        device: str = "cpu",
        chat_template: bool = True,
        models: ModelPair | None = None,
        seed: int | None = None,
    ) -> None:
        """`seed` makes unseeded sampled requests (rejection sampling) repeatable run to run;
        requests with their own `SamplingParams.seed` are reproducible regardless."""
        self.spec = spec or SpecConfig()
        self.models = models or load_pair(
            target, draft, dtype=dtype, draft_dtype=draft_dtype, device=device, need_draft=self.spec.speculative
        )
        self.chat_template = chat_template
        self.seed = seed
        self.stop_ids = eos_token_ids(self.models.target, self.models.tokenizer)
        self.stats = EngineStats()

    def make_engine(self) -> Engine:
        return build_engine(self.models.target, self.spec, self.stop_ids, draft_model=self.models.draft, seed=self.seed)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.models.tokenizer, prompt, self.chat_template)
        return list(prompt)

    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Every prompt's output, in input order."""
        done = {o.index: o for o in self.stream(prompts, params)}
        return [done[i] for i in range(len(prompts))]

    def stream(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield each request's output as soon as it finishes (refused prompts first)."""
        params = params or SamplingParams()
        per_request = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise BatchspecError(f"{len(per_request)} sampling params for {len(prompts)} prompts")
        engine = self.make_engine()
        accepted: list[int] = []
        ids: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else None
            try:
                ids[i] = self.encode(prompt)
                validate_prompt(ids[i], per_request[i], engine.limit)
            except BatchspecError as err:
                yield RequestOutput(i, text, ids.get(i, []), error=str(err))
                continue
            accepted.append(i)
        if not accepted:
            return
        start = time.perf_counter()
        try:
            for seq in engine.stream([ids[i] for i in accepted], [per_request[i] for i in accepted]):
                index = accepted[seq.index]
                yield self._output(index, prompts[index], seq, start)
        finally:
            self._add_stats(engine.stats)

    def _output(self, index: int, prompt: Prompt, seq: Sequence, start: float) -> RequestOutput:
        return RequestOutput(
            index=index,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=seq.prompt_ids,
            text=self.models.tokenizer.decode(seq.generated, skip_special_tokens=True),
            token_ids=list(seq.generated),
            finish_reason=seq.finish_reason,
            rounds=seq.rounds,
            drafted=seq.drafted,
            accepted=seq.accepted,
            time_to_first_token=(seq.first_token_time or start) - start,
            latency=(seq.finish_time or start) - start,
        )

    def _add_stats(self, run: EngineStats) -> None:
        for f in fields(EngineStats):
            if f.name != "extra":
                setattr(self.stats, f.name, getattr(self.stats, f.name) + getattr(run, f.name))
        for name, value in run.extra.items():
            self.stats.extra[name] = self.stats.extra.get(name, 0) + value
