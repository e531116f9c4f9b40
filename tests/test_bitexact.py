"""Exact means bit for bit: with a target edited to hold a near-tie (two tokens' logits 5e-6 apart at
one position of plain decoding), every method, scheduler and drafter reproduces plain decoding's
tokens, which only logits equal to plain decoding's bit for bit can guarantee (the rounding of
torch's own SDPA kernel differs by 1e-5 to 1e-4 between a one-token step and a verify). The
logit-level checks of each forward are in test_kv.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from test_kv import plain_logits
from tinyworld import ScriptedCosts, perturbed_copy, random_prompts, tiny_model

from batchspec.cli import main as cli_main
from batchspec.config import NGRAM, BatchspecError, ModelConfig, SamplingParams, SpecConfig
from batchspec.kernels import apply_linear_kernel
from batchspec.build import build_engine
from batchspec.methods import SCHEDULERS, correct_methods
from batchspec.models import load_pair
from batchspec.reference import greedy_decode

MAX_NEW = 12
TIE_AT = 5  # the generated position whose two best tokens are made 5e-6 apart
GAP = 5e-6


@functools.cache
def world() -> tuple[torch.nn.Module, torch.nn.Module, list[list[int]]]:
    """A tiny target whose output row for the runner-up at TIE_AT of prompt 0 is moved to within GAP
    of the winner (along that position's final hidden state), packed linears (row-invariant), and a
    drafter close enough to it that drafts are often accepted right across the tie."""
    model = tiny_model("qwen2", seed=4)
    prompts = random_prompts(3, [7, 11, 4], seed=5, vocab=96)
    generated = greedy_decode(model, prompts[0], MAX_NEW)
    hidden: list[torch.Tensor] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, out: hidden.append(args[0][0, -1]))
    logits = plain_logits(model, prompts[0], generated[:-1])[TIE_AT]
    hook.remove()
    h = hidden[TIE_AT]
    best, second = logits.topk(2).indices.tolist()
    if head.weight is model.get_input_embeddings().weight:  # tied: move the output row only
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    with torch.no_grad():
        head.weight[second] += (logits[best] - logits[second] - GAP) * h / h.dot(h)
    draft = perturbed_copy(model, noise=0.01, seed=1)
    apply_linear_kernel(model, "auto")
    apply_linear_kernel(draft, "auto")
    return model, draft, prompts


def test_the_edited_target_holds_a_near_tie_in_plain_decoding():
    model, _, prompts = world()
    generated = greedy_decode(model, prompts[0], MAX_NEW)
    top = plain_logits(model, prompts[0], generated[:-1])[TIE_AT].topk(2).values
    assert 0 <= float(top[0] - top[1]) < 4 * GAP


def _valid(method: str, scheduler: str) -> bool:
    try:
        SpecConfig(method=method, scheduler=scheduler)
    except BatchspecError:  # e.g. eqspec has static batches only
        return False
    return True


CASES = [(m, s, k, {}) for m in correct_methods() for s in SCHEDULERS if _valid(m, s)
         for k in ((1,) if m == "ar" else (1, 3))]
CASES += [("ragged", "continuous", 3, {"speculation": "adaptive"}),
          ("ragged", "continuous", 3, {"drafter": "hybrid", "ngram_min": 1, "ngram_max": 2}),
          ("ragged", "continuous", 3, {"max_prefill_tokens": 4})]


@pytest.mark.parametrize("method, scheduler, k, fields", CASES)
def test_every_method_and_scheduler_decodes_through_a_near_tie_as_plain_decoding_does(method, scheduler, k, fields):
    model, draft, prompts = world()
    spec = SpecConfig(method=method, scheduler=scheduler, num_draft_tokens=k, batch_size=2,
                      **{"speculation": "fixed", **fields})
    engine = build_engine(model, spec, draft_model=draft if spec.speculative else None,
                          costs=ScriptedCosts(1.0, 0.01, 0.05))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, seq in zip(prompts, outputs):
        assert seq.generated == greedy_decode(model, prompt, MAX_NEW), f"prompt {seq.index} diverged"


# ---- half-precision targets: refused, since their products are not batch-invariant ------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "fp16"])
def test_half_precision_targets_are_refused_before_loading(dtype):
    with pytest.raises(BatchspecError, match="not batch-invariant.*float32"):
        load_pair(ModelConfig(target="/nonexistent/model", draft=NGRAM, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engines_refuse_a_half_precision_target_built_by_hand(dtype):
    model = tiny_model("llama").to(dtype)
    with pytest.raises(BatchspecError, match="not batch-invariant"):
        build_engine(model, SpecConfig(method="ar"))


def test_a_half_precision_drafter_is_fine_and_the_cli_says_one_line(tmp_path, tiny_pair_dirs, capsys):
    target, draft = tiny_pair_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c"}\n')
    out = tmp_path / "o.jsonl"
    args = ["generate", "--prompts", str(prompts), "--target", str(target), "--draft", str(draft),
            "--max-new-tokens", "4", "--output", str(out)]
    assert cli_main(args + ["--draft-dtype", "bfloat16", "--verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact_match"] == "1/1"
    assert summary["weights"]["target"].startswith("float32") and summary["weights"]["target"].endswith("exact attention")
    assert cli_main(args + ["--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "float16 target is not batch-invariant" in err[0]
