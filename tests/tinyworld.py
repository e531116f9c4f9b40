"""Tiny models, a tiny tokenizer and rigged drafters for tests (no downloads, seconds to build)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    FalconH1Config,
    GPT2Config,
    GraniteMoeHybridConfig,
    LlamaConfig,
    Lfm2Config,
    Mamba2Config,
    OlmoHybridConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from batchspec.config import SamplingParams
from batchspec.drafters import Draft, Drafter, Picker, pick_argmax
from batchspec.engine import Engine
from batchspec.sequence import Sequence
from batchspec.speculation import RoundPlan, Speculation

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find"
).split()
SPECIALS = ["<s>", "</s>", "<unk>"]
VOCAB_SIZE = len(SPECIALS) + len(WORDS)


TINY_ARCHS = ("llama", "qwen2", "gpt2")


def _tiny_config(arch: str, vocab_size: int, hidden: int, layers: int, init_std: float) -> PreTrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "initializer_range": init_std,
        "tie_word_embeddings": False,
        "pad_token_id": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **common)
    decoder: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **common,
    }
    if arch == "llama":
        return LlamaConfig(**decoder)
    if arch == "qwen2":
        return Qwen2Config(**decoder)
    raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def tiny_model(
    arch: str, vocab_size: int = 96, seed: int = 0, hidden: int = 64, layers: int = 2, init_std: float = 0.5
) -> PreTrainedModel:
    """A small random fp32 model for tests: same ``seed`` gives the same weights.

    The large ``init_std`` spreads the logits so greedy argmax has no near-ties that batching noise
    could flip. Llama/Qwen2 use 4 query heads over 2 KV heads (GQA); GPT-2 has learned absolute
    positions, so the suite also covers position handling that is not rotary.
    """
    config = _tiny_config(arch, vocab_size, hidden, layers, init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


# ---- models with recurrent state (SSM / linear attention, pure and hybrid) ------------------------
_ATTENTION = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_GATED_DELTANET = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, **_ATTENTION)
_MAMBA2_HYBRID = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, **_ATTENTION)

# Per architecture: its config class and the sizes of a tiny instance (hidden size 64).
_TINY: dict[str, tuple[type[PreTrainedConfig], dict[str, Any]]] = {
    "mamba2": (Mamba2Config, dict(num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                                  chunk_size=8)),
    # three Gated DeltaNet layers, then one attention layer (as in the real models)
    "qwen3_next": (Qwen3NextConfig, dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         **_GATED_DELTANET)),
    "qwen3_5_text": (Qwen3_5TextConfig, dict(num_hidden_layers=4, **_GATED_DELTANET)),
    "olmo_hybrid": (OlmoHybridConfig, dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=16, linear_value_head_dim=16, **_ATTENTION)),
    # every layer runs attention and a Mamba2 mixer side by side
    "falcon_h1": (FalconH1Config, dict(num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                                       mamba_d_state=16, mamba_chunk_size=8, **_ATTENTION)),
    "granitemoehybrid": (GraniteMoeHybridConfig, dict(num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
                                                      num_local_experts=4, num_experts_per_tok=2,
                                                      shared_intermediate_size=64, **_MAMBA2_HYBRID)),
    "bamba": (BambaConfig, dict(num_hidden_layers=4, attn_layer_indices=[1], **_MAMBA2_HYBRID)),
    "lfm2": (Lfm2Config, dict(num_hidden_layers=4, full_attn_idxs=[1, 3], **_ATTENTION)),
}
TINY_STATEFUL_ARCHS = tuple(_TINY)


def tiny_stateful_model(arch: str, vocab_size: int = 96, seed: int = 0, init_std: float = 0.5) -> PreTrainedModel:
    """A small random fp32 model with recurrent state: the same `seed` gives the same weights. The
    large `init_std` spreads the logits so that greedy choices have no near-ties (as `tiny_model`).
    Attention is transformers' default (sdpa where the model has attention layers; Mamba2 has none)."""
    if arch not in _TINY:
        raise ValueError(f"unknown tiny stateful architecture {arch!r}; choose one of {', '.join(_TINY)}")
    config_class, sizes = _TINY[arch]
    config = config_class(vocab_size=vocab_size, hidden_size=64, initializer_range=init_std, tie_word_embeddings=False,
                          pad_token_id=None, bos_token_id=0, eos_token_id=1, **sizes)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0/1/2 are <s>/</s>/<unk> (bos/eos of the tiny models)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """A drafter that mostly agrees with `model`: same weights plus Gaussian noise, so acceptance is
    partial and ragged across rows, as with a real small drafter."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp(min=1e-3))
    return draft


def save_pair(root: Path, arch: str = "llama", noise: float = 0.02) -> tuple[Path, Path]:
    """Save a tiny target and a perturbed drafter, with the tiny tokenizer, as HF folders."""
    tok = tiny_tokenizer()
    target = tiny_model(arch, vocab_size=VOCAB_SIZE, seed=0)
    draft = perturbed_copy(target, noise, seed=1)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.generation_config.eos_token_id = 1
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def random_prompts(count: int, lengths: list[int], seed: int, vocab: int = VOCAB_SIZE) -> list[list[int]]:
    """Token-id prompts avoiding the special ids 0..2."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Within: torch computes on `count` threads (the tiny-model tests run on one, conftest); kernels
    whose blocking depends on the thread count are checked at 1 and 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def next_turn(engine: Engine, first_length: int, params: SamplingParams) -> tuple[list[int], list[int], list[int], list[int], int]:
    """A chat's two turns through `engine`: a first prompt of `first_length` tokens, then the
    conversation so far plus a new turn. Returns (first prompt, its answer, the second prompt, the
    second turn's output) and how many prefix-cache hits the second turn added."""
    first = random_prompts(1, [first_length], seed=62)[0]
    answer = engine.generate([first], params)[0].generated
    second = first + answer + random_prompts(1, [7], seed=63)[0]
    hits = engine.stats.prefix_cache_hits
    output = engine.generate([second], params)[0].generated
    return first, answer, second, output, engine.stats.prefix_cache_hits - hits


class ScriptedDrafter(Drafter):
    """Proposes the target's known greedy continuation, right with probability `p_right[row]` per
    token (else a wrong token), so tests control how ragged acceptance gets. p = 1 always right,
    p = 0 always wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], p_right: float | list[float], vocab: int, seed: int = 0):
        self.continuations = continuations
        self.p_right = p_right
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        rows = []
        for s in seqs:
            truth = self.continuations[tuple(s.prompt_ids)]
            p = self.p_right if isinstance(self.p_right, float) else self.p_right[s.index % len(self.p_right)]
            row = []
            for j in range(k):
                pos = len(s.generated) + j
                right = truth[pos] if pos < len(truth) else self.rng.randrange(self.vocab)
                row.append(right if self.rng.random() < p else (right + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
            rows.append(row)
        return Draft(torch.tensor(rows, dtype=torch.long), None)


class ScriptedCosts:
    """A cost model for tests, so no decision depends on timing: a verify forward costs
    `verify_base + verify_token * rows * tokens`, a drafter forward `draft_step`, plus `draft_token` per
    row and token beyond the two a drafting step feeds (a catch-up: a prompt it has not prefilled), and
    `prompt_share` of that on the drafter's prompt path.
    The rounds the engine reports are kept in `observed` and change nothing."""

    def __init__(self, verify_base: float = 1.0, verify_token: float = 0.1, draft_step: float = 0.2,
                 draft_token: float = 0.0, prompt_share: float = 1.0) -> None:
        self.verify_base, self.verify_token, self.draft_step = verify_base, verify_token, draft_step
        self.draft_token = draft_token
        self.prompt_share = prompt_share  # a forward on the drafter's prompt path, as a share of draft_time's
        self.observed: list[tuple[int, int, int]] = []

    def verify_time(self, rows: int, tokens: int) -> float:
        return self.verify_base + self.verify_token * rows * tokens

    def draft_time(self, rows: int, tokens: int) -> float:
        return self.draft_step + self.draft_token * rows * max(0, tokens - 2)

    def prompt_time(self, tokens: int) -> float:
        return self.draft_time(1, tokens) * self.prompt_share

    def overhead(self) -> float:
        return 0.0

    def observe(self, rows: int, width: int, steps: int, draft_s: float, verify_s: float, other_s: float) -> None:
        self.observed.append((rows, width, steps))


class ScheduledSpeculation(Speculation):
    """A speculation policy for tests: round r drafts schedule[r] steps (cycled; 0 is a plain decoding
    step) and row b of request i verifies at most caps[i % len(caps)] of them, so rounds without
    drafts, speculative rounds and rows of different lengths within a round come exactly as a test
    wants them."""

    def __init__(self, schedule: list[int], caps: list[int] | None = None) -> None:
        self.schedule, self.caps = schedule, caps
        self.round = 0
        self.seqs: list[Sequence] = []
        self.steps = 0

    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None, allowance: int | None = None,
             fast: list[bool] | None = None) -> RoundPlan:
        steps = self.schedule[self.round % len(self.schedule)]
        self.round += 1
        self.seqs = seqs
        self.steps = max(0, min(steps, max(s.remaining for s in seqs) - 1))  # what the last round planned
        return RoundPlan(self.steps)

    def settle(self, plan: RoundPlan, draft: Draft) -> Draft:
        if self.caps is None:
            return draft
        return draft.capped(torch.tensor([self.caps[s.index % len(self.caps)] for s in self.seqs]))


class LengthsDrafter(Drafter):
    """Proposes the target's known greedy continuation in every slot, padding included, but declares
    only lengths[i % len(lengths)] of them for request i: padding the target would accept, so only
    acceptance's per-row cap keeps a row from taking more than it proposed."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], lengths: list[int]) -> None:
        self.continuations, self.lengths = continuations, lengths

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        rows = []
        for s in seqs:
            truth = self.continuations[tuple(s.prompt_ids)]
            start = len(s.generated)
            rows.append([truth[start + j] if start + j < len(truth) else 3 for j in range(k)])
        lengths = torch.tensor([min(k, self.lengths[s.index % len(self.lengths)]) for s in seqs])
        return Draft(torch.tensor(rows, dtype=torch.long).view(len(seqs), k), None, lengths)


def mixed_prompts_file(tmp_path: Path, *more: str) -> Path:
    """A prompts file with every kind of input the CLI meets: good prompts, SpecBench turns, a bad
    line, an empty and an over-long prompt (plus `more` prompt texts)."""
    import json

    lines = [
        json.dumps({"id": "a", "prompt": "the water is long"}),
        json.dumps({"id": "empty", "prompt": "   "}),
        "{not json",
        json.dumps({"id": "b", "turns": ["call him now and then", "ignored second turn"]}),
        json.dumps({"id": "long", "prompt": "word " * 600}),
        json.dumps({"id": "c", "prompt": "write the number"}),
        *(json.dumps({"id": chr(ord("d") + i), "prompt": text}) for i, text in enumerate(more)),
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_oracle_matches_generate(model: torch.nn.Module) -> None:
    """The tests' oracle (plain batch-1 greedy decoding) equals transformers' own greedy `generate`
    on a few prompts, 1 to 13 tokens long."""
    from batchspec.reference import greedy_decode

    for prompt in random_prompts(3, [1, 6, 13], seed=5):
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy_decode(model, prompt, 12) == hf
