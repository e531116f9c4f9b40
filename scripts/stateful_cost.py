"""What keeping recurrent state costs: snapshot vs replay, a verify of K+1 tokens vs one token, and
the state bookkeeping's share of decoding (`EngineStats.extra["state_time"]`).

    PYTHONPATH=. python scripts/stateful_cost.py --archs mamba2 qwen3_next --sizes tiny moderate

Part 1 runs verification rounds on a stateful layout directly: feed K+1 tokens to every row, then
commit a random accepted length per row (leading drafts accepted with probability --acceptance), and
times the forward and the commit separately, for each strategy; one-token rounds give the baseline.
Part 2 decodes prompts with the engine (`ragged`, a drafter right with probability --acceptance)
and prints where the time went. `batchspec bench` does not print `state_time` (its tables are
another module's); this script does. docs/stateful.md records a run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Mamba2Config, PreTrainedModel, Qwen3NextConfig

from batchspec.build import build_engine
from batchspec.config import SamplingParams, SpecConfig
from batchspec.kv import is_stateful
from batchspec.layouts import RaggedLayout
from batchspec.layouts.stateful import ReplayStatefulLayout, StatefulLayout
from batchspec.reference import greedy_decode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tinyworld import ScriptedDrafter, tiny_stateful_model  # noqa: E402  (the tests' helpers)

VOCAB = 1024
STRATEGIES = {"snapshot": StatefulLayout, "replay": ReplayStatefulLayout}


def moderate_model(arch: str) -> PreTrainedModel:
    """A randomly initialised model of a few tens of millions of parameters, with the real chunk sizes."""
    common = dict(vocab_size=VOCAB, initializer_range=0.1, tie_word_embeddings=False, pad_token_id=None,
                  bos_token_id=0, eos_token_id=1)
    if arch == "mamba2":
        config = Mamba2Config(hidden_size=512, num_heads=16, head_dim=64, state_size=64, n_groups=1, expand=2,
                              num_hidden_layers=8, chunk_size=256, **common)
    elif arch == "qwen3_next":
        config = Qwen3NextConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                                 linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                 max_position_embeddings=4096, **common)
    else:
        raise SystemExit(f"no moderate config for {arch}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def build(arch: str, size: str) -> PreTrainedModel:
    return tiny_stateful_model(arch, vocab_size=VOCAB) if size == "tiny" else moderate_model(arch)


def accepted_counts(rows: int, k: int, p: float, rng: random.Random) -> list[int]:
    """Tokens kept per row in a round: the fed token plus the leading drafts accepted (each with p)."""
    counts = []
    for _ in range(rows):
        n = 1
        while n <= k and rng.random() < p:
            n += 1
        counts.append(n)
    return counts


def layout_rounds(model: PreTrainedModel, layout_class: type[StatefulLayout], batch: int, width: int, rounds: int,
                  prompt_len: int, k: int, p: float) -> dict[str, float]:
    """Mean seconds per round of `forward` (width tokens per row) and of `commit`, and the state
    bookkeeping inside both."""
    rng = random.Random(0)
    layout = layout_class(model, batch, prompt_len + rounds * width + 1)
    layout.prefill([[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(batch)])
    layout.commit(layout.lengths.clone())
    forward = commit = 0.0
    state_before = layout.state_time
    for _ in range(rounds):
        tokens = torch.randint(3, VOCAB, (batch, width))
        start = time.perf_counter()
        layout.forward(tokens)
        forward += time.perf_counter() - start
        keep = accepted_counts(batch, width - 1, p, rng) if width > 1 else [1] * batch
        start = time.perf_counter()
        layout.commit(layout.committed + torch.tensor(keep))
        commit += time.perf_counter() - start
    return {"forward": forward / rounds, "commit": commit / rounds, "state": (layout.state_time - state_before) / rounds}


def engine_run(model: PreTrainedModel, layout_class: type[StatefulLayout], prompts: list[list[int]],
               truth: dict[tuple[int, ...], list[int]], batch: int, k: int, p: float, max_new: int) -> dict[str, float]:
    spec = SpecConfig(method="ragged", num_draft_tokens=k, batch_size=batch)
    def layouts(m: torch.nn.Module, rows: int, capacity: int) -> RaggedLayout | StatefulLayout:
        return (layout_class if is_stateful(m) else RaggedLayout)(m, rows, capacity)

    engine = build_engine(model, spec, drafter=ScriptedDrafter(truth, p, VOCAB, seed=1), layout=layouts)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
    assert all(o.generated == truth[tuple(pr)] for pr, o in zip(prompts, outputs)), "not exact"
    s = engine.stats
    return {"decode": s.decode_time, "verify": s.verify_time, "other": s.other_time,
            "state": s.extra["state_time"], "tok_s": s.generated / s.decode_time, "replays": s.extra["state_replay_forwards"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["mamba2", "qwen3_next"])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "moderate"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--acceptance", type=float, default=0.6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, K {args.k}, acceptance {args.acceptance}, prompt {args.prompt_len} tokens, "
          f"{args.threads} thread(s); times in ms per round unless noted")
    for arch in args.archs:
        for size in args.sizes:
            model = build(arch, size)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            print(f"\n{arch} {size} ({params:.1f}M parameters)")
            print(f"{'strategy':10s} {'fwd 1 tok':>10s} {'fwd K+1':>10s} {'K+1 / 1':>8s} {'commit':>8s} {'state':>8s} {'state %':>8s}")
            for name, layout_class in STRATEGIES.items():
                one = layout_rounds(model, layout_class, args.batch, 1, args.rounds, args.prompt_len, args.k, args.acceptance)
                many = layout_rounds(model, layout_class, args.batch, args.k + 1, args.rounds, args.prompt_len, args.k,
                                     args.acceptance)
                round_time = many["forward"] + many["commit"]
                print(f"{name:10s} {one['forward'] * 1e3:10.2f} {many['forward'] * 1e3:10.2f} "
                      f"{many['forward'] / one['forward']:8.2f} {many['commit'] * 1e3:8.2f} {many['state'] * 1e3:8.2f} "
                      f"{100 * many['state'] / round_time:7.1f}%")
            rng = random.Random(2)
            prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, args.prompt_len))] for _ in range(2 * args.batch)]
            truth = {tuple(p): greedy_decode(model, p, args.max_new_tokens) for p in prompts}
            print(f"{'engine':10s} {'tok/s':>8s} {'decode s':>9s} {'verify s':>9s} {'other s':>8s} {'state s':>8s} "
                  f"{'state %':>8s} {'replays':>8s}")
            for name, layout_class in STRATEGIES.items():
                r = engine_run(model, layout_class, prompts, truth, args.batch, args.k, args.acceptance, args.max_new_tokens)
                print(f"{name:10s} {r['tok_s']:8.1f} {r['decode']:9.2f} {r['verify']:9.2f} {r['other']:8.2f} "
                      f"{r['state']:8.2f} {100 * r['state'] / r['decode']:7.1f}% {int(r['replays']):8d}")


if __name__ == "__main__":
    main()
