"""SpecConfig and SamplingParams refuse what would otherwise fail deep inside torch or decode garbage."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchspec.config import DEFAULT_PREFILL_TOKENS, BatchspecError, SamplingParams, SpecConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": math.nan}, "temperature must be a finite number, got nan"),
        ({"temperature": math.inf}, "temperature must be a finite number, got inf"),
        ({"temperature": "0.7"}, "temperature must be a finite number, got '0.7'"),
        ({"top_p": math.nan}, "top_p must be a finite number, got nan"),
        ({"top_p": -math.inf}, "top_p must be a finite number, got -inf"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
        ({"top_k": 1.0}, "top_k must be an integer, got 1.0"),
        ({"seed": "x"}, "seed must be an integer or None, got 'x'"),
        ({"seed": 1.5}, "seed must be an integer or None, got 1.5"),
        ({"seed": False}, "seed must be an integer or None, got False"),
        ({"temperature": 1e-39}, "temperature must be 0 (greedy) or >= 0.01, got 1e-39: dividing logits by less "
                                 "overflows them"),
        ({"temperature": 0.009}, "temperature must be 0 (greedy) or >= 0.01, got 0.009: dividing logits by less "
                                 "overflows them"),
    ],
)
def test_sampling_params_refuse_non_finite_and_non_integer_values(kwargs: dict, message: str) -> None:
    with pytest.raises(BatchspecError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_draft_tokens": 2.5}, "num_draft_tokens must be an integer, got 2.5"),
        ({"batch_size": True}, "batch_size must be an integer, got True"),
        ({"batch_size": "4"}, "batch_size must be an integer, got '4'"),
        ({"window_size": 8.0}, "window_size must be an integer or None, got 8.0"),
        ({"max_kv_slots": "1024"}, "max_kv_slots must be an integer or None, got '1024'"),
        ({"generator_seed": 2**64}, "generator_seed must be in 0..2**64-1, got 18446744073709551616"),
        ({"generator_seed": -1}, "generator_seed must be in 0..2**64-1, got -1"),
    ],
)
def test_spec_config_refuses_non_integer_sizes(kwargs: dict, message: str) -> None:
    with pytest.raises(BatchspecError) as err:
        SpecConfig(**kwargs)
    assert str(err.value) == message


def test_integer_and_real_types_other_than_int_and_float_are_accepted() -> None:
    params = SamplingParams(max_new_tokens=np.int64(8), temperature=np.float32(0.5), top_k=0, seed=np.int32(3))
    assert params.max_new_tokens == 8 and not params.greedy
    assert SpecConfig(method="exspec", batch_size=np.int64(2), window_size=4, max_kv_slots=None).batch_size == 2
    assert SamplingParams(temperature=1).temperature == 1  # an int temperature is a number


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="ragged", num_draft_tokens=0), "num_draft_tokens must be >= 1"),
        (dict(batch_size=0), "batch_size must be >= 1"),
        (dict(method="medusa"), "unknown method"),
        (dict(method="eqspec", scheduler="continuous"), "continuous batching needs per-row cursors"),
        (dict(method="ragged", scheduler="pool"), "method ragged supports the continuous and static schedulers"),
        (dict(max_prefill_tokens=-1), "max_prefill_tokens must be >= 0"),
        (dict(method="eqspec", max_prefill_tokens=4), "max_prefill_tokens .chunked prefill. needs the continuous"),
        (dict(generator_seed="1"), "generator_seed must be an integer or None"),
        (dict(method="exspec", batch_size=4, window_size=2), r"window_size \(2\) must be >= batch_size \(4\)"),
    ],
)
def test_bad_spec_is_one_clear_error(kwargs, message):
    with pytest.raises(BatchspecError, match=message):
        SpecConfig(**kwargs)


def test_chunked_prefill_is_the_continuous_schedulers_default():
    """The continuous scheduler bounds each step's prefill by default, 0 turns it off; the static and
    pool schedulers prefill whole prompts without being refused for the default (or for 0)."""
    assert SpecConfig(method="ragged").prefill_budget == DEFAULT_PREFILL_TOKENS
    assert SpecConfig(method="ar", scheduler="continuous").prefill_budget == DEFAULT_PREFILL_TOKENS
    assert SpecConfig(method="ragged", max_prefill_tokens=0).prefill_budget is None
    assert SpecConfig(method="ragged", max_prefill_tokens=7).prefill_budget == 7
    for spec in (SpecConfig(method="ar"), SpecConfig(method="exspec"), SpecConfig(method="ragged", scheduler="static"),
                 SpecConfig(method="eqspec", max_prefill_tokens=0)):
        assert spec.prefill_budget is None, spec


def test_bad_sampling_params_are_clear_errors():
    with pytest.raises(BatchspecError, match="max_new_tokens must be >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(BatchspecError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(BatchspecError, match="stop_token_ids entries must be an integer, got 2.5"):
        SamplingParams(stop_token_ids=(3, 2.5))
    with pytest.raises(BatchspecError, match="stop_token_ids must be a list of token ids, got 7"):
        SamplingParams(stop_token_ids=7)
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)


def test_window_size_is_only_checked_where_a_pool_uses_it():
    assert SpecConfig(method="ragged", batch_size=8, window_size=2).window_size == 2


def test_the_smallest_temperature_keeps_logits_finite_and_zero_stays_greedy() -> None:
    import torch

    from batchspec.config import MIN_TEMPERATURE
    from batchspec.sampling import filter_logits

    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.tensor([[[-300.0, 0.0, 600.0]]], dtype=dtype)  # beyond any real model's logits
        assert torch.isfinite(filter_logits(logits, [SamplingParams(temperature=MIN_TEMPERATURE)])).all()
    SpecConfig(generator_seed=2**64 - 1)  # the largest seed torch takes
