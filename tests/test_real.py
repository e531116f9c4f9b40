"""The bundled Qwen2.5-Coder 1.5B target / 0.5B drafter on SpecBench prompts: both layouts at batch 4
must equal plain batch-1 greedy decoding of each prompt alone, token for token, in fp32.

Runs when the pair is installed (`make setup`); with BATCHSPEC_REQUIRE_REAL=1 (CI) a missing pair
fails instead of skipping.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from tinyworld import ScriptedCosts

from batchspec.bench.specbench import SPECBENCH_FILE, task_group
from batchspec.bundled import bundled_installed
from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.llm import LLM
from batchspec.models import encode_prompt, load_pair
from batchspec.prompts import load_prompts
from batchspec.reference import greedy_decode

pytestmark = pytest.mark.real
MAX_NEW = 32


@pytest.fixture(autouse=True, scope="module")
def all_cores():
    """A 1.5B model wants every core (conftest keeps tiny-model tests on one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)


@functools.cache
def pair():
    if not (bundled_installed("target") and bundled_installed("draft")):
        if os.environ.get("BATCHSPEC_REQUIRE_REAL") == "1":
            pytest.fail("bundled model pair not installed (run `make setup`)")
        pytest.skip("bundled model pair not installed (run `make setup`)")
    return load_pair(ModelConfig())


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    """8 SpecBench prompts: the shortest of each task group, then the two shortest left (short
    prompts keep CPU prefill affordable; the ragged-acceptance paths are the same)."""
    records = sorted(load_prompts(SPECBENCH_FILE), key=lambda r: len(r.text))
    chosen, groups = [], set()
    for r in records:
        if task_group(r.category) not in groups:
            groups.add(task_group(r.category))
            chosen.append(r)
    chosen += [r for r in records if r not in chosen][: 8 - len(chosen)]
    tok = pair().tokenizer
    return tuple(tuple(encode_prompt(tok, r.text)) for r in chosen)


@functools.cache
def oracle() -> list[list[int]]:
    models = pair()
    llm = LLM(spec=SpecConfig(method="ar", batch_size=1), models=models)
    return [greedy_decode(models.target, list(p), MAX_NEW, llm.stop_ids) for p in prompts()]


@pytest.mark.parametrize("method", ["ragged", "eqspec"])
def test_real_pair_matches_plain_greedy(method):
    spec = SpecConfig(method=method, num_draft_tokens=5, batch_size=4, speculation="fixed", check_invariants=False)
    llm = LLM(spec=spec, models=pair())
    outputs = llm.generate([list(p) for p in prompts()], SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.error for o in outputs] == [None] * 8
    mismatched = [o.index for o, ref in zip(outputs, oracle()) if o.token_ids != ref]
    assert mismatched == [], f"{method}: prompts {mismatched} diverged from plain greedy decoding"
    assert llm.stats.accepted > 0  # the drafter really drafted, and some drafts were kept


@pytest.mark.parametrize("speculation, drafter", [("adaptive", "model"), ("adaptive", "hybrid"), ("fixed", "ngram")])
def test_real_pair_adaptive_and_lookup_match_plain_greedy(speculation, drafter):
    """Widths chosen per round (on a scripted cost model shaped like this CPU's: a 6-token verify ~2.3x
    a 1-token one, a drafter step ~0.4x), n-gram rows with and without matches: still plain greedy."""
    spec = SpecConfig(method="ragged", num_draft_tokens=5, batch_size=4, speculation=speculation, drafter=drafter,
                      ngram_min=2, ngram_max=4)
    llm = LLM(spec=spec, models=pair(), costs=ScriptedCosts(verify_base=0.29, verify_token=0.1, draft_step=0.16))
    outputs = llm.generate([list(p) for p in prompts()], SamplingParams(max_new_tokens=MAX_NEW))
    mismatched = [o.index for o, ref in zip(outputs, oracle()) if o.token_ids != ref]
    assert mismatched == [], f"{speculation} {drafter}: prompts {mismatched} diverged from plain greedy decoding"
    assert llm.stats.drafted > 0


def test_real_pair_text_prompts_and_error_records():
    """Text in, text out, through the chat template; a bad prompt is recorded, the others answered. The
    defaults: ragged speculates adaptively, on the real pair's costs measured here."""
    llm = LLM(spec=SpecConfig(method="ragged", num_draft_tokens=4, batch_size=2), models=pair())
    outputs = llm.generate(["Write a Python function that adds two numbers.", "   "], SamplingParams(max_new_tokens=12))
    assert outputs[1].error == "empty prompt"
    assert "def" in outputs[0].text
    ids = encode_prompt(pair().tokenizer, "Write a Python function that adds two numbers.")
    assert outputs[0].token_ids == greedy_decode(pair().target, ids, 12, llm.stop_ids)


def test_real_int4_target_with_int8_prefill_matches_its_plain_greedy():
    """The bundled target in int4 from its GGUF blocks with `--prefill-kernel int8` (prompt tokens as
    int8 x int8 products), the drafter int4: chunked prefill that splits prompts mid-way, batch 4, still
    plain greedy decoding of that same model, prompt by prompt."""
    models = load_pair(ModelConfig(quantization="int4", draft_quantization="int4", prefill_kernel="int8"))
    spec = SpecConfig(method="ragged", num_draft_tokens=4, batch_size=4, speculation="fixed", scheduler="continuous",
                      max_prefill_tokens=48)
    llm = LLM(spec=spec, models=models, costs=ScriptedCosts(verify_base=0.1, verify_token=0.03, draft_step=0.04))
    chosen = [list(p) for p in prompts()[:4]]
    outputs = llm.generate(chosen, SamplingParams(max_new_tokens=24))
    mismatched = [o.index for o, p in zip(outputs, chosen)
                  if o.token_ids != greedy_decode(models.target, p, 24, llm.stop_ids)]
    assert mismatched == [], f"prompts {mismatched} diverged from plain greedy decoding of the int4 + int8-prefill target"
    assert llm.stats.accepted > 0
