"""Scheduling policies: who gets rows, which rows run, and EXSPEC's pool end to end."""

from __future__ import annotations

import functools
from collections import deque

import torch
from tinyworld import VOCAB_SIZE, perturbed_copy, random_prompts, tiny_model

from batchspec.config import SamplingParams, SpecConfig
from batchspec.build import build_engine
from batchspec.reference import greedy_decode
from batchspec.scheduler import ContinuousScheduler, PoolScheduler, StaticScheduler
from batchspec.sequence import Sequence


@functools.cache
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = tiny_model("llama", vocab_size=VOCAB_SIZE, seed=0)
    return target, perturbed_copy(target, noise=0.02, seed=1)


def seqs(lengths: list[int]) -> list[Sequence]:
    return [Sequence(i, [5] * n, SamplingParams(), frozenset()) for i, n in enumerate(lengths)]


def test_static_admits_only_into_an_empty_batch():
    policy = StaticScheduler(SpecConfig(method="eqspec", batch_size=3))
    waiting = deque(seqs([2, 3, 4, 5]))
    assert policy.take(waiting, running=1, free_rows=2) == []
    assert [s.index for s in policy.take(waiting, running=0, free_rows=3)] == [0, 1, 2]
    assert [s.index for s in waiting] == [3]


def test_continuous_refills_every_free_row():
    policy = ContinuousScheduler(SpecConfig(method="ragged", batch_size=3))
    waiting = deque(seqs([2, 3, 4]))
    assert [s.index for s in policy.take(waiting, running=2, free_rows=1)] == [0]
    assert [s.index for s in policy.take(waiting, running=0, free_rows=5)] == [1, 2]


def test_pool_admits_a_batch_per_step_shortest_first_when_sorting():
    policy = PoolScheduler(SpecConfig(method="exspec", batch_size=2, window_size=6, sort_by_length=True))
    waiting = deque(seqs([9, 3, 7, 1, 5]))
    assert [len(s.prompt_ids) for s in policy.take(waiting, running=0, free_rows=6)] == [1, 3]
    assert [len(s.prompt_ids) for s in waiting] == [9, 7, 5]


def test_pool_prefers_a_same_length_group_then_the_least_recently_run():
    policy = PoolScheduler(SpecConfig(method="exspec", batch_size=3, window_size=6))
    window = seqs([5, 7, 5, 9, 5])
    assert policy.select(window, round_index=1) == [0, 2, 4]  # the three rows of length 5
    window[0].generated, window[2].generated = [1], [1, 2]  # lengths now 6, 7, 7... no group of 3
    assert policy.select(window, round_index=2) == [1, 3, 0]  # never run first, then the oldest
    assert policy.counters() == {"grouped_rounds": 1, "fallback_rounds": 1}


def test_pool_remembers_only_the_rows_in_its_window():
    """A long-running server passes thousands of requests through the window: what the scheduler
    remembers of them stays bounded by the window."""
    policy = PoolScheduler(SpecConfig(method="exspec", batch_size=2, window_size=4))
    everyone = seqs([3] * 400)
    for start in range(0, 400, 4):
        policy.select(everyone[start : start + 4], round_index=start)
        assert set(policy.last_run) <= {s.index for s in everyone[start : start + 4]}


def test_exspec_groups_same_length_rows_and_refills_the_window():
    """Equal-length prompts form same-length groups (no padding at all); the window refills as
    rows finish, and every prompt is answered exactly."""
    target, draft = pair()
    prompts = random_prompts(12, [6, 6, 6, 6, 9, 9, 9, 9, 3, 3, 3, 3], seed=8)
    params = [SamplingParams(max_new_tokens=4 + i % 5) for i in range(len(prompts))]
    spec = SpecConfig(method="exspec", num_draft_tokens=3, batch_size=4, window_size=8, sort_by_length=True,
                      check_invariants=True)
    engine = build_engine(target, spec, draft_model=draft)
    outputs = engine.generate(prompts, params)
    for p, sp, seq in zip(prompts, params, outputs):
        assert seq.generated == greedy_decode(target, p, sp.max_new_tokens)
    assert engine.stats.extra["grouped_rounds"] > 0
    assert engine.stats.extra["grouped_rounds"] + engine.stats.extra["fallback_rounds"] == engine.stats.rounds


def test_exspec_starts_decoding_before_the_whole_window_is_prefilled():
    """The window fills batch_size rows per step, so the first requests decode while later ones
    still wait for their prefill (EXSPEC used to prefill its whole window before any round)."""
    target, draft = pair()
    engine = build_engine(target, SpecConfig(method="exspec", num_draft_tokens=2, batch_size=2, window_size=8),
                          draft_model=draft)
    prompts = random_prompts(8, [4, 6], seed=2)
    engine.reserve(8, 40)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=6))
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 6 and engine.stats.rounds == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.prefill_tokens == sum(map(len, prompts))
