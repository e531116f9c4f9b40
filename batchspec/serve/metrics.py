"""Prometheus metrics of one server, named as vLLM names them so existing dashboards work.

Each app gets its own CollectorRegistry: the global default registry would refuse a second app in
the same process (tests start several) and would mix their counts.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (seconds), so histograms line up with its dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class Metrics:
    """The server's counters. Updated from the engine thread (prometheus_client is thread-safe);
    `num_positions` (K) pre-creates the per-position acceptance series, so a position that never
    accepted shows as 0 rather than missing (a longer draft, e.g. from an adaptive K, adds series)."""

    def __init__(self, model_name: str, num_positions: int) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def make(kind: type, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs: object):
            return kind(name, doc, ("model_name", *extra), registry=self.registry, **kwargs)

        self._running = make(Gauge, "vllm:num_requests_running", "Requests decoding (holding a row).").labels(**label)
        self._waiting = make(Gauge, "vllm:num_requests_waiting", "Requests waiting for a row.").labels(**label)
        self.time_to_first_token = make(Histogram, "vllm:time_to_first_token_seconds",
                                        "Time from arrival to the first generated token.",
                                        buckets=TTFT_BUCKETS).labels(**label)
        self.e2e_latency = make(Histogram, "vllm:e2e_request_latency_seconds", "Time from arrival to the end.",
                                buckets=E2E_BUCKETS).labels(**label)
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of admitted requests.").labels(**label)
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Generated tokens.").labels(**label)
        # in tokens, as vLLM counts them: prompt tokens looked up, and those whose K/V the cache held
        self.prefix_cache_queries = make(Counter, "vllm:prefix_cache_queries",
                                         "Prefix cache queries, in prompt tokens looked up.").labels(**label)
        self.prefix_cache_hits = make(Counter, "vllm:prefix_cache_hits",
                                      "Prefix cache hits, in prompt tokens not computed.").labels(**label)
        success = make(Counter, "vllm:request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self._success = {r: success.labels(finished_reason=r, **label) for r in FINISH_REASONS}
        self.num_drafts = make(Counter, "vllm:spec_decode_num_drafts", "Drafts proposed (one per row per round).") \
            .labels(**label)
        self.num_draft_tokens = make(Counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.") \
            .labels(**label)
        self.num_accepted_tokens = make(Counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.") \
            .labels(**label)
        per_pos = make(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                       "Draft tokens accepted at each draft position (0 = the first drafted token).", ("position",))
        self._per_pos = lambda position: per_pos.labels(position=str(position), **label)  # noqa: E731
        for position in range(num_positions):
            self._per_pos(position)

    def set_load(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """The gauges read the engine loop's counts when scraped, so they are never stale."""
        self._running.set_function(running)
        self._waiting.set_function(waiting)

    def record_draft(self, draft_tokens: int, accepted: int) -> None:
        """One row's draft of `draft_tokens` tokens, of which the first `accepted` were kept."""
        self.num_drafts.inc()
        self.num_draft_tokens.inc(draft_tokens)
        self.num_accepted_tokens.inc(accepted)
        for position in range(accepted):
            self._per_pos(position).inc()

    def finished(self, reason: str, latency: float) -> None:
        self._success[reason].inc()
        self.e2e_latency.observe(latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
