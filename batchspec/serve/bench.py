"""`batchspec bench-serve`: load a running OpenAI-compatible server the way clients do (the official
`openai` client, streaming) and report what they would see.

Figures follow vLLM's `bench serve`: TTFT is the time to the first chunk with content, TPOT the
time after it divided by the remaining output tokens, ITL the gaps between successive chunks. A
speculative server sends all the tokens a round accepts in one chunk, so ITL is per chunk (a gap
can cover several tokens) and is not comparable to per-token ITL; TPOT is. The speculation and
prefix cache counters are read from the server's /metrics before and after the run.

Workloads that repeat prompt prefixes, for the prefix cache: every request may start with one shared
system prompt (`BenchSettings.system`), and a conversation may have a second turn (`follow_up`), sent
after the first answer arrives with the first turn and its answer resent before it, as chat clients do.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import urllib.error
import urllib.request
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import openai
from prometheus_client.parser import text_string_to_metric_families

from ..errors import BatchspecError

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PREFIX_COUNTERS = ("vllm:prompt_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class BenchSettings:
    base_url: str
    api_key: str | None = None
    model: str | None = None  # None: the server's first model
    endpoint: str = "chat"  # chat | completions
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None  # request i gets seed + i
    concurrency: int | None = 4  # requests in flight at most (None: no bound)
    request_rate: float | None = None  # Poisson arrivals per second (None: all at once)
    system: str | None = None  # a system prompt every request starts with
    follow_up: str | None = None  # a second user turn, sent after the first turn's answer


@dataclass
class RequestResult:
    """One request as the client saw it (seconds; `chunk_times` since the request was sent)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""  # what the client received, to compare servers (e.g. speculative vs plain)
    error: str | None = None


def metrics_url(base_url: str) -> str:
    """/metrics of the server whose API lives at `base_url` (…/v1)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urlunsplit((parts.scheme, parts.netloc, path + "/metrics", "", ""))


def scrape(url: str) -> dict[str, float]:
    """The speculation and prefix cache counters (summed over label sets; per position keyed
    `name[position]`)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as err:
        raise BatchspecError(f"cannot read the server's metrics at {url}: {getattr(err, 'reason', err)}") from None
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = sample.name[: -len("_total")]
            if name == PER_POSITION:
                name = f"{name}[{sample.labels.get('position')}]"
            elif name not in SPEC_COUNTERS + PREFIX_COUNTERS:
                continue
            counters[name] = counters.get(name, 0.0) + sample.value
    return counters


async def _one(
    client: openai.AsyncOpenAI, settings: BenchSettings, model: str, turns: list[str], index: int
) -> RequestResult:
    """One request: `turns` alternate user and assistant texts (a first turn, or a first turn, its
    answer and a follow-up), after the shared system prompt if any."""
    result = RequestResult()
    common = {"model": model, "max_tokens": settings.max_tokens, "temperature": settings.temperature,
              "stream": True, "stream_options": {"include_usage": True}}
    if settings.seed is not None:
        common["seed"] = settings.seed + index
    start = time.perf_counter()
    try:
        if settings.endpoint == "chat":
            system = [{"role": "system", "content": settings.system}] if settings.system else []
            messages = [{"role": "assistant" if i % 2 else "user", "content": t} for i, t in enumerate(turns)]
            stream = await client.chat.completions.create(messages=system + messages, **common)
        else:
            text = "\n\n".join([*([settings.system] if settings.system else []), *turns])
            stream = await client.completions.create(prompt=text, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
            piece = _text(chunk.choices[0], settings.endpoint) if chunk.choices else ""
            if piece:
                result.chunk_times.append(time.perf_counter() - start)
                result.text += piece
    except openai.APIError as err:
        result.error = f"{type(err).__name__}: {getattr(err, 'message', err)}"
    result.latency = time.perf_counter() - start
    result.ttft = result.chunk_times[0] if result.chunk_times else None
    return result


def _text(choice: object, endpoint: str) -> str:
    if endpoint == "chat":
        return getattr(choice.delta, "content", None) or ""  # type: ignore[attr-defined]
    return getattr(choice, "text", "") or ""


async def run_bench(settings: BenchSettings, prompts: Seq[str]) -> dict:
    """Send every prompt (at the configured rate and concurrency); the figures as a dict."""
    client = openai.AsyncOpenAI(base_url=settings.base_url, api_key=settings.api_key or "none", max_retries=0,
                                timeout=600)
    try:
        model = settings.model or await _first_model(client, settings.base_url)
        before = scrape(metrics_url(settings.base_url))
        gate = asyncio.Semaphore(settings.concurrency) if settings.concurrency else None
        arrivals = random.Random(0)

        async def conversation(i: int, prompt: str) -> list[RequestResult]:
            first = await _one(client, settings, model, [prompt], i)
            if settings.follow_up is None or first.error is not None:
                return [first]
            return [first, await _one(client, settings, model, [prompt, first.text, settings.follow_up], i)]

        async def limited(i: int, prompt: str) -> list[RequestResult]:
            if gate is None:
                return await conversation(i, prompt)
            async with gate:
                return await conversation(i, prompt)

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(i, prompt)))
            if settings.request_rate and i + 1 < len(prompts):
                await asyncio.sleep(arrivals.expovariate(settings.request_rate))
        conversations = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = scrape(metrics_url(settings.base_url))
    finally:
        await client.close()
    report = summarize([r for c in conversations for r in c], duration)
    firsts = [c[0] for c in conversations]
    report["prompts"] = list(prompts)
    report["outputs"] = [r.text if r.error is None else None for r in firsts]  # one per prompt, in order
    if settings.follow_up is not None:  # what the cache changes most: the second turn's first token
        report["ttft_ms_by_turn"] = [percentiles([r.ttft for r in turn if r.ttft is not None])
                                     for turn in (firsts, [c[1] for c in conversations if len(c) > 1])]
    report["model"] = model
    report["speculation"] = speculation(before, after)
    report["prefix_cache"] = prefix_cache(before, after)
    return report


async def _first_model(client: openai.AsyncOpenAI, base_url: str) -> str:
    """The server's model; also the reachability check, so a wrong URL is one clear line."""
    try:
        models = await client.models.list()
    except openai.AuthenticationError:
        raise BatchspecError(f"the server at {base_url} refused the API key (401): pass the right --api-key") from None
    except openai.APIConnectionError as err:
        cause = err.__cause__ or err
        raise BatchspecError(f"cannot reach the server at {base_url}: {cause}") from None
    except openai.APIStatusError as err:
        raise BatchspecError(f"the server at {base_url} answered {err.status_code} to GET /models") from None
    if not models.data:
        raise BatchspecError(f"the server at {base_url} lists no model")
    return models.data[0].id


def percentiles(values: Seq[float], scale: float = 1000.0) -> dict[str, float | None]:
    """Mean and P50/P90/P99 (linear interpolation, as numpy), in ms by default."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = (len(ordered) - 1) * q
        low, high = math.floor(pos), math.ceil(pos)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    figures = {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}
    return {k: round(v * scale, 3) for k, v in figures.items()}


def summarize(results: Seq[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": round(duration, 3),
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output,
        "request_throughput": round(len(ok) / duration, 3) if duration > 0 else None,
        "output_throughput": round(output / duration, 3) if duration > 0 else None,
        "tokens_per_chunk": round(output / chunks, 3) if chunks else None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_latency_ms": percentiles([r.latency for r in ok]),
    }


def speculation(before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's share of the server's speculation counters (after minus before)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0.0)
    draft_tokens = delta.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    prefix = PER_POSITION + "["
    positions = sorted((int(k[len(prefix) : -1]), v) for k, v in delta.items() if k.startswith(prefix))
    return {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        # tokens a row gains per round: its accepted drafts plus the target's own token
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "per_position_acceptance_rate": [round(v / drafts, 4) if drafts else None for _, v in positions],
    }


def prefix_cache(before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's prompt tokens as the server counted them: sent, computed (not found in its prefix
    cache) and the cache's hit rate (hits over queries, both in tokens, as vLLM counts them)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in PREFIX_COUNTERS}
    sent, queries, hits = (int(delta[k]) for k in PREFIX_COUNTERS)
    return {"prompt_tokens_sent": sent, "prompt_tokens_computed": sent - hits,
            "hit_rate": round(hits / queries, 4) if queries else None}


def format_report(report: dict) -> str:
    """vLLM-style text table."""
    lines = ["=" * 18 + " Serving benchmark " + "=" * 18]

    def row(label: str, value: object) -> None:
        lines.append(f"{label:<42}{'-' if value is None else value:>14}")

    row("Model:", report["model"])
    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    if report["first_error"]:
        lines.append(f"  first error: {report['first_error']}")
    row("Benchmark duration (s):", report["duration_s"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Mean tokens per chunk:", report["tokens_per_chunk"])
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency (per chunk)"), ("e2e_latency_ms", "End-to-end Latency")):
        lines.append(f"{' ' + title + ' ':-^55}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {short} (ms):", report[key][stat])
    lines.append("  (one chunk carries every token a round accepted, so a chunk gap can cover several tokens)")
    for turn, figures in enumerate(report.get("ttft_ms_by_turn", []), 1):
        row(f"P50 / P99 TTFT, turn {turn} (ms):", f"{figures['p50']} / {figures['p99']}")
    cache = report["prefix_cache"]
    lines.append(f"{' Prefix cache (server /metrics) ':-^55}")
    row("Prompt tokens sent:", cache["prompt_tokens_sent"])
    row("Prompt tokens computed:", cache["prompt_tokens_computed"])
    row("Hit rate (tokens):", cache["hit_rate"])
    spec = report["speculation"]
    lines.append(f"{' Speculative decoding (server /metrics) ':-^55}")
    row("Drafts:", spec["drafts"])
    row("Draft tokens:", spec["draft_tokens"])
    row("Accepted tokens:", spec["accepted_tokens"])
    row("Acceptance rate:", spec["acceptance_rate"])
    row("Mean acceptance length:", spec["mean_acceptance_length"])
    for position, rate in enumerate(spec["per_position_acceptance_rate"]):
        row(f"Acceptance rate at position {position}:", rate)
    lines.append("=" * 55)
    return "\n".join(lines)

