"""What a run cost: wall time by phase and counters, summed over rounds, engines and Ray workers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class EngineStats:
    """Wall time by phase (seconds) and counters, summed over a run."""

    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    other_time: float = 0.0  # acceptance, commits/realignment, masks, bookkeeping
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled (target)
    prefill_fed: int = 0  # token positions the target's prefill forwards computed (prompt + padding)
    # prompt tokens looked up in the target's prefix cache, and those it filled (not computed): in
    # tokens, as vLLM's vllm:prefix_cache_queries and vllm:prefix_cache_hits count them
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # measuring the cost model (once per machine and model, at the first reserve): in no phase above,
    # and left out of every tokens/s, end to end included
    calibration_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    def merge(self, other: EngineStats) -> None:
        """Add another run's totals to these (several engines' runs, or Ray workers' reports)."""
        for f in fields(EngineStats):
            if f.name != "extra":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for name, value in other.extra.items():
            self.extra[name] = self.extra.get(name, 0) + value
