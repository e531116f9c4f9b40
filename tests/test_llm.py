"""The Python API (`batchspec.LLM`): what a user passes in, and that a bad request never costs the
others their outputs."""

from __future__ import annotations

import functools

import pytest
from tinyworld import random_prompts

from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.llm import LLM
from batchspec.build import build_engine
from batchspec.reference import greedy_decode


@pytest.fixture(scope="module")
def llm(tiny_pair_dirs) -> LLM:
    target, draft = tiny_pair_dirs
    return LLM(ModelConfig(str(target), str(draft)), spec=SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2))


@functools.cache
def plain(llm: LLM, prompt: tuple[int, ...], max_new: int) -> list[int]:
    return greedy_decode(llm.models.target, list(prompt), max_new, llm.stop_ids)


def test_a_single_string_is_one_prompt(llm):
    outputs = llm.generate("the water is long", SamplingParams(max_new_tokens=6))
    assert len(outputs) == 1
    out = outputs[0]
    assert out.prompt == "the water is long" and out.error is None
    assert out.token_ids == plain(llm, tuple(out.prompt_token_ids), 6)


def test_a_single_list_of_ids_is_one_prompt(llm):
    prompt = random_prompts(1, [5], seed=2)[0]
    outputs = llm.generate(prompt, SamplingParams(max_new_tokens=6))
    assert len(outputs) == 1 and outputs[0].token_ids == plain(llm, tuple(prompt), 6)


def test_bad_prompts_get_errors_and_the_others_their_outputs(llm):
    good = random_prompts(2, [4, 7], seed=3)
    vocab = llm.models.target.get_input_embeddings().num_embeddings
    prompts = [good[0], [5, vocab, 6], [5, -1], None, 17, "  ", [], good[1], [5, True]]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.index for o in outputs] == list(range(len(prompts)))
    errors = [o.error for o in outputs]
    assert errors[0] is None and errors[7] is None
    assert f"token id {vocab} is not in the model's vocabulary" in errors[1]
    assert "token id -1 is not in the model's vocabulary" in errors[2]
    assert "got NoneType" in errors[3] and "got int" in errors[4]
    assert errors[5] == "empty prompt" and errors[6] == "empty prompt"
    assert "token id True" in errors[8]
    assert outputs[0].token_ids == plain(llm, tuple(good[0]), 6)
    assert outputs[7].token_ids == plain(llm, tuple(good[1]), 6)
    assert all(o.token_ids == [] for o in outputs if o.error is not None)


def test_a_prompt_beyond_the_kv_budget_is_refused_alone(llm):
    short, long = random_prompts(2, [3, 30], seed=4)
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, max_kv_slots=3 + 8 + 4)
    budgeted = LLM(llm.model_config, spec=spec, models=llm.models)
    outputs = budgeted.generate([long, short], SamplingParams(max_new_tokens=8))
    assert "needs 42 K/V slots, more than max_kv_slots 15" in outputs[0].error
    assert outputs[1].error is None and outputs[1].token_ids == plain(llm, tuple(short), 8)


def test_kv_buffer_is_sized_for_the_prompts_not_the_batch_size(llm):
    """A huge --batch-size with 3 prompts must not allocate 200000 rows."""
    prompts = random_prompts(3, [4, 6, 5], seed=5)
    for method in ("ragged", "exspec"):
        engine = build_engine(llm.models.target, SpecConfig(method=method, num_draft_tokens=2, batch_size=200_000),
                              llm.stop_ids, draft_model=llm.models.draft)
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=5))
        layout = engine.rows.home
        assert layout.store.max_rows == 3 and layout.store.data.shape[2] == 3
        assert [s.generated for s in outputs] == [plain(llm, tuple(p), 5) for p in prompts]


def test_sampling_params_count_must_match(llm):
    from batchspec.config import BatchspecError

    with pytest.raises(BatchspecError, match="2 sampling params for 1 prompts"):
        llm.generate(["the water"], [SamplingParams(), SamplingParams()])


def test_a_lone_surrogate_is_an_error_for_that_prompt_only(llm):
    outputs = llm.generate(["the water is long", "\ud800 x", "call him now"], SamplingParams(max_new_tokens=4))
    assert "lone surrogate U+D800 at character 1" in outputs[1].error and outputs[1].token_ids == []
    assert outputs[0].error is None and outputs[2].error is None and outputs[2].token_ids


@pytest.mark.parametrize("prompts, params, message", [
    (5, None, "prompts must be a string, a list of token ids or a list of prompts, got int"),
    (None, None, "got NoneType"),
    (b"the water", None, "got bytes"),
    (["the water"], {"max_new_tokens": 8}, "got dict: pass SamplingParams(**settings)"),
    (["the water"], "greedy", "got str"),
    (["the water"], 8, "got int"),
    (["the water"], [{"max_new_tokens": 8}], "got a dict among them"),
])
def test_arguments_of_the_wrong_type_are_a_clear_type_error(llm, prompts, params, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        llm.generate(prompts, params)
