"""`--prefill-kernel int8`: prompt tokens of quantized linears as int8 x int8 products
(`kernels.PREFILL_INT8`). Exactness rests on two facts tested here: the product is batch-invariant
(a row's result does not depend on the other rows), and every prompt token takes it wherever it is
computed (whole prefill, chunks, a prefix-cache fill, plain decoding, transformers' generate) while
every generated token takes the weights' own kernel."""

from __future__ import annotations

import json

import pytest
import torch
from tinyworld import (VOCAB_SIZE, ScheduledSpeculation, ScriptedCosts, next_turn, perturbed_copy, random_prompts,
                       save_pair, tiny_model, tiny_tokenizer, torch_threads)

from batchspec.build import build_engine
from batchspec.cli import main
from batchspec.config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from batchspec.forensics.audit import Auditor
from batchspec.forensics.audit_inputs import AuditItem
from batchspec.forensics.compare import SYNC_ERROR
from batchspec.kernels import (
    INT_MM_MIN_ROWS,
    PROMPT_SCALE_BLOCK,
    QuantizedLinear,
    apply_quantization,
    has_prompt_path,
    pack_linears,
    quantization_kernel_reason,
    scale_blocks,
    weight_bytes,
    weights_summary,
)
from batchspec.kv import forward_plain, new_dynamic_cache, prompt_first_forwards
from batchspec.models import draft_prefill_kernel, load_model, load_pair, weights_report
from batchspec.reference import greedy_decode, reference_decode
from batchspec.roles import prompt_pass, prompt_positions

pytestmark = pytest.mark.skipif(quantization_kernel_reason("int4", torch.device("cpu"), prompt_int8=True) is not None,
                                reason="torch's quantized CPU kernels or _int_mm do not run here")

SHAPES = [(256, 256), (512, 128), (128, 512), (32, 256), (64, 3200)]  # K = 3200: activation scales per 800
KINDS = [("int8", 32), ("int4", 32), ("int4", 128)]


def layer(shape: tuple[int, int], bits: str, group: int, prompt_int8: bool = True) -> QuantizedLinear:
    torch.manual_seed(0)
    out_features, in_features = shape
    return QuantizedLinear(torch.nn.Linear(in_features, out_features), bits, group, prompt_int8)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits, group", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_prompt_rows_product_does_not_depend_on_the_other_rows(shape, bits, group, threads):
    """A row alone (padded up to the kernel's least row count) equals, bit for bit, the same row
    first or last inside 2..300 rows (several slices of PROMPT_ROWS) whose others are random and
    scaled x100, and inside a [batch, tokens] input."""
    quantized = layer(shape, bits, group)
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(64, shape[1], generator=generator)
    with torch_threads(threads), torch.no_grad(), prompt_pass():
        alone = torch.cat([quantized(rows[i:i + 1]) for i in range(8)])
        for m in [2, 5, 16, INT_MM_MIN_ROWS, 31, 64, 129, 300]:
            others = torch.randn(m, shape[1], generator=generator) * 100
            batch = torch.cat([rows[:1], others[1:-1], rows[1:2]]) if m > 1 else rows[:1]
            out = quantized(batch)
            assert torch.equal(out[:1], alone[:1]), f"row 0 changed inside {m} rows"
            assert torch.equal(out[-1:], alone[1:2] if m > 1 else alone[:1]), f"the last of {m} rows changed"
        tokens = quantized(rows[:12].reshape(3, 4, shape[1]))  # [batch, tokens, features]
        assert torch.equal(tokens.reshape(12, -1)[:8], alone)


def test_activation_scale_blocks_split_the_inputs_evenly_and_stay_narrow():
    assert [scale_blocks(k) for k in (64, 1536, 1537, 3200, 8960)] == [1, 1, 29, 4, 7]
    for k in range(1, 5000, 7):
        blocks = scale_blocks(k)
        assert k % blocks == 0 and k // blocks <= PROMPT_SCALE_BLOCK


@pytest.mark.parametrize("in_features", [512, 3200])
@pytest.mark.parametrize("bits, group", KINDS)
def test_only_a_prompt_pass_takes_the_prompt_product_and_it_stays_close(bits, group, in_features):
    """Outside a prompt pass the layer computes exactly what it computes without a prompt path; inside,
    another product (so the routing tests below are not vacuous), close to the float product, with
    one activation scale (K = 512) and with four (K = 3200)."""
    shape = (256, in_features)
    with_path, without = layer(shape, bits, group), layer(shape, bits, group, prompt_int8=False)
    x = torch.randn(20, in_features)
    with torch.no_grad():
        assert torch.equal(with_path(x), without(x))
        with prompt_pass():
            prompt = with_path(x)
        weights = without(x)
    assert not torch.equal(prompt, weights)
    assert float((prompt - weights).norm() / weights.norm()) < 0.03
    if bits == "int8":  # the int8 weights themselves: no second copy
        assert with_path.prompt_weight.data_ptr() == with_path.qweight.data_ptr()


def quantized_pair(arch: str, quantization: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    target = tiny_model(arch, vocab_size=VOCAB_SIZE)
    draft = perturbed_copy(target, noise=0.02, seed=1)
    apply_quantization(target, quantization, prompt_int8=True)
    apply_quantization(draft, "int4" if quantization == "int8" else "int8")
    pack_linears(target)
    pack_linears(draft)
    return target, draft


def test_the_prompt_path_changes_what_plain_decoding_computes():
    """The oracle's prefill takes the prompt path: its logits differ from the weights' kernel's (so an
    engine that skipped the prompt pass anywhere would diverge from it)."""
    target, _ = quantized_pair("qwen2", "int4")
    prompt = torch.tensor([random_prompts(1, [12], seed=5)[0]])
    with torch.inference_mode():
        weights = forward_plain(target, prompt, new_dynamic_cache(target))
        with prompt_pass():
            prompt_logits = forward_plain(target, prompt, new_dynamic_cache(target))
    assert not torch.equal(weights, prompt_logits)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("method, scheduler, speculation, chunk", [
    ("ragged", "continuous", "fixed", 5), ("ragged", "continuous", "adaptive", 0), ("ragged", "static", "fixed", None),
    ("eqspec", None, "fixed", None), ("exspec", "pool", "fixed", None), ("ar", "continuous", None, 3),
])
def test_engines_with_a_prompt_path_equal_plain_decoding(quantization, method, scheduler, speculation, chunk):
    """Whole, chunked and pooled prefills, padded rectangles and adaptive rounds on targets and drafters
    with a prompt path: every output is plain decoding of its prompt alone, token for token, greedy
    and seeded."""
    target, draft = quantized_pair("llama", quantization)
    prompts = random_prompts(6, [1, 4, 9, 13, 20, 4], seed=3)
    spec = SpecConfig(method=method, scheduler=scheduler, speculation=speculation, num_draft_tokens=4, batch_size=3,
                      max_prefill_tokens=chunk, check_invariants=True)
    engine = build_engine(target, spec, (), draft_model=draft if method != "ar" else None,
                          costs=ScriptedCosts(1.0, 0.1, 0.2))
    for params in [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)]:
        outputs = engine.generate(prompts, params)
        for prompt, seq in zip(prompts, outputs):
            assert seq.generated == reference_decode(target, prompt, params), f"prompt {seq.index} diverged"


def test_a_chats_next_turn_is_exact_with_a_prompt_path():
    """A finished row keeps only its prompt in the prefix cache: its answer's K/V came from the
    weights' kernel, where plain decoding of the next turn computes those tokens as prompt."""
    target, draft = quantized_pair("qwen2", "int4")
    spec = SpecConfig(method="ragged", speculation="fixed", num_draft_tokens=3, batch_size=2,
                      prefix_cache_gb=0.01, check_invariants=True)
    engine = build_engine(target, spec, draft_model=draft)
    engine.reserve(rows=2, capacity=128)
    params = SamplingParams(max_new_tokens=20)
    first, _, second, output, hits = next_turn(engine, 37, params)
    assert output == reference_decode(target, second, params)
    assert hits == len(first) // 16 * 16  # the prompt's blocks, not the answer's


def test_transformers_generate_computes_its_prompt_on_the_prompt_path():
    """The bench's transformers baselines: generate's first forward (the prompt) takes the prompt path
    and its next ones do not, so its logits are plain decoding's bit for bit."""
    target, _ = quantized_pair("qwen2", "int8")
    prompt = random_prompts(1, [9], seed=4)[0]
    with torch.inference_mode(), prompt_first_forwards(target):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        cache = new_dynamic_cache(target)
        with prompt_pass():
            first = forward_plain(target, torch.tensor([prompt]), cache)
        second = forward_plain(target, out.sequences[:, len(prompt):len(prompt) + 1], cache)
    assert torch.equal(out.logits[0].float(), first.float()) and torch.equal(out.logits[1].float(), second.float())
    assert out.sequences[0, len(prompt):].tolist() == greedy_decode(target, prompt, 3)


def test_loading_names_the_prompt_path_and_counts_its_bytes(tmp_path):
    target_dir, draft_dir = save_pair(tmp_path)
    plain = load_pair(ModelConfig(str(target_dir), str(draft_dir), quantization="int4", draft_quantization="int8"))
    pair = load_pair(ModelConfig(str(target_dir), str(draft_dir), quantization="int4", draft_quantization="int8",
                                 prefill_kernel="int8"))
    assert not has_prompt_path(plain.target) and has_prompt_path(pair.target)
    assert "+prefill-int8 x" in weights_summary(pair.target) and "+prefill-int8" not in weights_summary(plain.target)
    assert "int8 x1" in weights_summary(pair.target)  # the output layer: no prompt path
    assert weight_bytes(pair.target) > weight_bytes(plain.target)
    # a quantized drafter has one whatever --prefill-kernel says (it changes no output); a float one none
    assert has_prompt_path(plain.draft) and "int8+prefill-int8 x" in weights_summary(plain.draft)
    float_draft = load_pair(ModelConfig(str(target_dir), str(draft_dir), quantization="int4", draft_quantization="none"))
    assert not has_prompt_path(float_draft.draft)


def test_a_report_without_the_models_names_the_prompt_paths_the_config_gives():
    """Models on Ray workers are reported from the config: the target's prompt path where
    --prefill-kernel asks for it, the drafter's wherever it is quantized."""
    report = weights_report(ModelConfig(quantization="int4", prefill_kernel="int8", draft_quantization="int4"))
    assert report["target"].endswith("quantization int4+prefill-int8")
    assert report["draft"].endswith("quantization int4+prefill-int8")
    report = weights_report(ModelConfig(quantization="int4", draft_quantization="none"))
    assert report["target"].endswith("quantization int4") and report["draft"].endswith("quantization none")


def test_a_drafter_without_the_int8_product_loads_without_a_prompt_path(monkeypatch):
    assert draft_prefill_kernel("int4", "cpu") == "int8" and draft_prefill_kernel("none", "cpu") == "weights"
    monkeypatch.setattr("batchspec.models.quantization_kernel_reason",
                        lambda bits, device, prompt_int8=False: "this torch build lacks aten._int_mm" if prompt_int8 else None)
    assert draft_prefill_kernel("int4", "cpu") == "weights"


def test_bad_prefill_kernel_settings_are_one_clear_line(tmp_path):
    with pytest.raises(BatchspecError, match="quantized targets"):
        ModelConfig(prefill_kernel="int8")
    with pytest.raises(BatchspecError, match="unknown prefill kernel"):
        ModelConfig(quantization="int4", prefill_kernel="fp8")
    with pytest.raises(BatchspecError, match="quantized targets"):  # the loader called directly, too
        load_model(str(save_pair(tmp_path)[0]), prefill_kernel="int8")


def test_the_audit_scores_and_calibrates_every_token_in_its_role():
    """The audit's teacher-forced scores are plain decoding's logits bit for bit (prompt tokens on the
    prompt path, the continuation on the weights' kernel), and its fp-tie margin measures our layouts
    with the same roles: no noise at all, where a forward of the wrong roles would have measured the
    gap between the two kernels as noise."""
    target, _ = quantized_pair("qwen2", "int4")
    prompts = random_prompts(4, [5, 11, 8, 14], seed=8)
    auditor = Auditor(target, tiny_tokenizer(), 10, calibration_rows=4)
    outputs = [greedy_decode(target, p, 10, auditor.stop_ids) for p in prompts]
    prompt, output, d = prompts[1], outputs[1], 3
    scores = auditor._scores(prompt + output[:d], output[d:], d)
    with torch.inference_mode():  # plain decoding's own logits, one step at a time
        cache = new_dynamic_cache(target)
        with prompt_pass():
            steps = [forward_plain(target, torch.tensor([prompt]), cache)[0]]
        for token in output[:-1]:
            steps.append(forward_plain(target, torch.tensor([[token]]), cache)[0])
    assert torch.equal(scores, torch.stack(steps[d:]))
    wrong = output[:d] + [int(scores[0].argmin())] + output[d + 1:]
    items = [AuditItem(f"p{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    report = auditor.audit([*items, AuditItem("wrong", prompt, wrong)])
    calibration = report["calibration"]
    assert set(calibration["noise"]) == {"ragged-verify", "padded-verify"}  # no left padding: roles go by position
    assert calibration["max_noise"] == 0.0 and calibration["margin"] == calibration["floor"]
    rows = {r["id"]: r for r in report["rows"]}
    assert all(rows[f"p{i}"]["exact_match"] for i in range(len(prompts)))
    assert rows["wrong"]["classification"] == SYNC_ERROR and rows["wrong"]["first_divergence"] == d


def test_an_int8_prefill_run_is_audited_from_the_command_line(tmp_path):
    """`generate` and `audit` with the same --quantization int4 --prefill-kernel int8: every output exact."""
    target_dir, draft_dir = save_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": {i}, "prompt": "{text}"}}\n' for i, text in
                               enumerate(["the cat sat", "a dog ran far away", "hello"])))
    outputs, report = tmp_path / "o.jsonl", tmp_path / "r.json"
    model = ["--target", str(target_dir), "--quantization", "int4", "--prefill-kernel", "int8", "--max-new-tokens", "8"]
    assert main(["generate", "--prompts", str(prompts), "-o", str(outputs), "--draft", str(draft_dir), *model]) == 0
    assert main(["audit", "--prompts", str(prompts), "--outputs", str(outputs), "--report", str(report), *model]) == 0
    totals = json.loads(report.read_text())["totals"]
    assert (totals["rows"], totals["exact_match"]) == (3, 3)


# ---- a quantized drafter's prompt path ------------------------------------------------------------
def prompt_path_pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A quantized target without a prompt path and an int4 drafter with one (as `load_pair` loads a
    quantized drafter)."""
    target = tiny_model(arch, vocab_size=VOCAB_SIZE)
    draft = perturbed_copy(target, noise=0.02, seed=1)
    apply_quantization(target, "int8")
    apply_quantization(draft, "int4", prompt_int8=True)
    pack_linears(target)
    pack_linears(draft)
    return target, draft


def spy_on_roles(model: torch.nn.Module) -> list[tuple[int, object]]:
    """(tokens per row, `prompt_positions()`) of every forward of `model`, from its first linear."""
    seen: list[tuple[int, object]] = []
    first = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    first.register_forward_pre_hook(lambda module, args: seen.append((args[0].shape[-2], prompt_positions())))
    return seen


@pytest.mark.parametrize("method, scheduler, speculation, chunk, cache", [
    ("ragged", "continuous", "adaptive", None, 0.0), ("ragged", "continuous", "adaptive", 24, 0.01),
    ("ragged", "static", "fixed", None, 0.0), ("ragged", "continuous", "fixed", 16, 0.01),
    ("eqspec", None, "fixed", None, 0.0), ("exspec", "pool", "fixed", None, 0.0),
])
def test_a_drafters_prompt_path_keeps_outputs_exact_and_its_cache_checkable(method, scheduler, speculation, chunk,
                                                                             cache):
    """A drafter's prefills, deferred ones and their pieces included, run on its prompt path and its
    drafting steps do not; the invariant checker recomputes every sampled drafter row's K/V with its
    leading `prompt_slots` on the prompt path and the rest not, and finds them equal each round
    (whole, chunked, pooled and padded layouts, a prefix cache); every output is plain decoding of
    its prompt alone."""
    target, draft = prompt_path_pair("qwen2")
    prompts = random_prompts(6, [40, 4, 45, 9, 36, 13], seed=3)
    spec = SpecConfig(method=method, scheduler=scheduler, speculation=speculation, num_draft_tokens=3, batch_size=3,
                      max_prefill_tokens=chunk, prefix_cache_gb=cache, check_invariants=True)
    engine = build_engine(target, spec, (), draft_model=draft, costs=ScriptedCosts(1.0, 0.1, 0.2, prompt_share=0.5))
    engine.reserve(rows=3, capacity=128)
    rectangles: list[object] = []  # the roles of the drafter's forwards over all the round's rows
    layout = engine.rows.drafter.layout
    forward = layout.forward
    layout.forward = lambda tokens, last_only=False: rectangles.append(prompt_positions()) or forward(tokens, last_only)
    drafter, checked = engine.rows.drafter, []
    views = drafter.views
    drafter.views = lambda seqs, sample_rows: checked.append(max(drafter.prompt_slots, default=0)) or views(seqs, sample_rows)
    params = SamplingParams(max_new_tokens=12)
    for _ in range(2):  # the second time through, a prefix cache holds the prompts
        outputs = engine.generate(prompts, params)
        for prompt, seq in zip(prompts, outputs):
            assert seq.generated == greedy_decode(target, prompt, 12), f"prompt {seq.index} diverged"
    assert max(checked) > 0  # rows the checker found computed on the prompt path where `prompt_slots` says
    assert rectangles and not any(rectangles)  # drafting steps and shared catch-ups never did
    assert sum(seq.accepted for seq in outputs) > 0


def test_a_long_catch_up_continues_the_prompt_path_only_where_it_ends():
    """Fed alone from where the slots its prompt path computed end (here the prefill at admission,
    after 40 plain steps), a long catch-up takes the prompt path too and extends those slots; once a
    drafting step has fed past them, the next long catch-up takes the weights' kernel. `backlog` says
    which before each, for the policy's pricing."""
    target, draft = prompt_path_pair("llama")
    seen = spy_on_roles(draft)
    spec = SpecConfig(method="ragged", speculation="fixed", num_draft_tokens=2, batch_size=1)
    engine = build_engine(target, spec, (), draft_model=draft)
    engine.reserve(rows=1, capacity=256)
    drafter = engine.rows.drafter
    assert drafter.prompt_path and not drafter.lazy  # fixed speculation: prefilled at admission
    engine.speculation = ScheduledSpeculation([0] * 40 + [2] * 5 + [0] * 40 + [2] * 30)
    prompt = random_prompts(1, [20], seed=8)[0]
    engine.add_request(prompt, SamplingParams(max_new_tokens=150))
    slots, fast = [], []
    while engine.has_unfinished():
        slots.append(list(drafter.prompt_slots))
        fast.append(drafter.backlog(engine.running).fast)
        output = engine.step()
    assert output[0].generated == greedy_decode(target, prompt, 150)
    assert slots[1] == [20]  # the prefill at admission (slots[i]: before step i)
    long = [roles for tokens, roles in seen if tokens > 32]  # the two catch-ups of 40 plain steps
    assert len(long) == 2 and long[0] and not long[1]
    assert fast[40] == [True] and slots[41] == [20 + 39] and fast[85] == [False] and slots[-1] == [59]
