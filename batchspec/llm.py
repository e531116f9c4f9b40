"""The Python API, shaped like the engines users know:

    llm = LLM(spec=SpecConfig(method="ragged", num_draft_tokens=5, batch_size=4))
    outputs = llm.generate(["Write a haiku about caches."], SamplingParams(max_new_tokens=64))

A batch loses nothing: every prompt comes back, in input order, with either an output or an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence as Seq
from dataclasses import asdict, dataclass, field

from .build import build_engine
from .config import BatchspecError, ModelConfig, SamplingParams, SpecConfig, resolve_drafter
from .costs import Costs
from .engine import Engine
from .logprobs import TokenLogprob
from .models import ModelPair, encode_prompt, eos_token_ids, load_pair
from .reference import prompt_logprobs
from .sequence import Sequence
from .stats import EngineStats
from .trace import NullTrace


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
    # per round: drafts proposed for this row, verified (0: speculation turned down), accepted
    proposed_k: list[int] = field(default_factory=list)
    chosen_k: list[int] = field(default_factory=list)
    accepted_k: list[int] = field(default_factory=list)
    time_to_first_token: float | None = None
    latency: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since the run started, per token
    # With SamplingParams.logprobs: one entry per generated token; with prompt_logprobs: one per prompt
    # token (None for the first). Equal bit for bit to plain decoding's (`batchspec.logprobs`).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_json(self) -> dict:
        return asdict(self)


# Text (encoded with the model's tokenizer, chat template applied per ModelConfig) or token ids.
Prompt = str | Seq[int]


class LLM:
    """A target (and drafter) plus a decoding method. Prompts may be text or token ids.

    `model` says which models to load (default: the bundled pair) and how to encode text; `models`
    passes models already loaded (e.g. shared by several LLMs), in which case only `model`'s
    encoding settings apply (and its `draft`: `ngram` drafts by prompt lookup). `costs` is the cost
    model adaptive speculation decides on (measured on first use when not given, then kept for every
    later call, so what the engines learn about this machine carries over). `trace` records what
    every engine step ran (`batchspec.trace.StepTrace`; the caller opens and closes it).
    """

    def __init__(
        self,
        model: ModelConfig | None = None,
        spec: SpecConfig | None = None,
        models: ModelPair | None = None,
        costs: Costs | None = None,
        trace: NullTrace | None = None,
    ) -> None:
        self.model_config = model or ModelConfig()
        self.spec = resolve_drafter(self.model_config, spec or SpecConfig())
        self.models = models or load_pair(self.model_config, need_draft=self.spec.needs_draft_model)
        self.stop_ids = eos_token_ids(self.models.target, self.models.tokenizer)
        self.stats = EngineStats()
        self.costs = costs
        self.trace = trace

    def make_engine(self) -> Engine:
        return build_engine(self.models.target, self.spec, self.stop_ids, draft_model=self.models.draft,
                            costs=self.costs, trace=self.trace)

    def encode(self, prompt: Prompt) -> list[int]:
        """Text through the tokenizer (and chat template); token ids as given (the engine checks them)."""
        if isinstance(prompt, str):
            config = self.model_config
            return encode_prompt(self.models.tokenizer, prompt, config.chat_template, config.allow_special_tokens)
        if isinstance(prompt, bytes) or not isinstance(prompt, Iterable):
            raise BatchspecError(f"a prompt must be text or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Every prompt's output, in input order. A single string is one prompt."""
        prompts = _as_list(prompts)
        done = {o.index: o for o in self.stream(prompts, params)}
        return [done[i] for i in range(len(prompts))]

    def stream(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield each request's output as soon as it finishes (refused prompts first, each with its
        `error`: a bad prompt never costs the others their outputs)."""
        prompts = _as_list(prompts)
        per_request = _per_request(params, len(prompts))
        engine = self.make_engine()
        accepted: list[int] = []
        ids: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else None
            try:
                ids[i] = engine.validate(self.encode(prompt), per_request[i])
            except BatchspecError as err:
                yield RequestOutput(i, text, [], error=str(err))
                continue
            accepted.append(i)
        if not accepted:
            return
        start = time.perf_counter()
        try:
            for seq in engine.stream([ids[i] for i in accepted], [per_request[i] for i in accepted]):
                index = accepted[seq.index]
                # times from the end of any cost calibration, which ran before the first sequence could finish
                yield self._output(index, prompts[index], seq, start + engine.stats.calibration_s)
        finally:
            self.stats.merge(engine.stats)
            self.costs = engine.parts.costs  # measured at the first reserve when not given

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
            proposed_k=list(seq.proposed_k),
            chosen_k=list(seq.chosen_k),
            accepted_k=list(seq.accepted_k),
            time_to_first_token=(seq.first_token_time or start) - start,
            latency=(seq.finish_time or start) - start,
            token_times=[round(t - start, 6) for t in seq.token_times],
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            # a property of the prompt alone: one plain forward of it, never the engine's prefill
            prompt_logprobs=(None if seq.params.prompt_logprobs is None
                             else prompt_logprobs(self.models.target, seq.prompt_ids, seq.params)),
        )


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """A lone string (or a lone list of token ids) is one prompt, not a batch of characters. Anything
    that is not a string or an iterable is a TypeError here, not one from deep inside (`generate(5)`);
    bytes too, which would otherwise be read as token ids."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray, dict)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a string, a list of token ids or a list of prompts, got "
                        f"{type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]
    return prompts



def _per_request(params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: `params` for all, or a list of one each. A dict of settings is
    refused with the fix (`SamplingParams(**settings)`), not an AttributeError from deep inside."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        hint = ": pass SamplingParams(**settings)" if isinstance(params, dict) else ""
        raise TypeError(f"params must be a SamplingParams or a list of them, one per prompt, got "
                        f"{type(params).__name__}{hint}")
    per_request = list(params)
    bad = next((p for p in per_request if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"params must be SamplingParams, one per prompt, got a {type(bad).__name__} among them")
    if len(per_request) != count:
        raise BatchspecError(f"{len(per_request)} sampling params for {count} prompts")
    return per_request
