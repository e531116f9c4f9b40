"""What a quantized drafter's prompt path buys: one row's forward of n tokens by the weights' kernel
and by the int8 prompt path (`roles.prompt_pass`), the best of a few runs each, in milliseconds.

    python scripts/drafter_prompt_path.py [--quantization int4] [--tokens 1 4 8 17 32 64 128 256]

Loads the bundled drafter as `load_pair` does for a quantized drafter (docs/quantization.md, "Its
prompt path"). Run it on a quiet machine; prefix it with `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` for an AVX2 CPU's kernels.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch

from batchspec.costs import cpu_description
from batchspec.models import load_model
from batchspec.roles import prompt_pass


def best_ms(model: torch.nn.Module, tokens: int, prompt: bool, runs: int) -> float:
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        with torch.inference_mode(), prompt_pass() if prompt else nullcontext():
            model(ids, logits_to_keep=1)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="int4", choices=["int8", "int4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 17, 32, 64, 128, 256])
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    model, _ = load_model(None, role="draft", quantization=args.quantization, prefill_kernel="int8")
    print(f"bundled drafter, {args.quantization}, {cpu_description()}, {torch.get_num_threads()} threads; "
          f"one row, best of {args.runs}")
    print(f"{'tokens':>6}  {'weights ms':>10}  {'prompt path ms':>14}  {'ratio':>5}")
    for n in args.tokens:
        weights, prompt = best_ms(model, n, False, args.runs), best_ms(model, n, True, args.runs)
        print(f"{n:>6}  {weights:>10.1f}  {prompt:>14.1f}  {weights / prompt:>5.2f}")


if __name__ == "__main__":
    main()
