"""What the exact attention path costs: `kv._exact_attention` against torch's fused SDPA kernel on the
bundled target's attention shapes (Qwen2.5-Coder-1.5B: 12 query heads over 2 K/V heads of 128, 28
layers), per forward summed over the layers, for a one-token step, a 6-token verify and a prefill
chunk at a few batch sizes and context lengths. Paired and interleaved repeats; median of each.

    python scripts/attention_price.py [--threads N] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from batchspec.kv.attention import _exact_attention

LAYERS, HEADS, KV_HEADS, DIM = 28, 12, 2, 128


def _inputs(rows: int, tokens: int, context: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, HEADS, tokens, DIM, generator=gen)
    k = torch.randn(rows, KV_HEADS, context, DIM, generator=gen)
    v = torch.randn(rows, KV_HEADS, context, DIM, generator=gen)
    slots = torch.arange(context)
    mask = (slots[None, :] <= torch.arange(context - tokens, context)[:, None])[None, None].expand(rows, 1, -1, -1)
    return q, k, v, mask.contiguous()


def _exact(q, k, v, mask):
    return _exact_attention(SimpleNamespace(), q, k, v, mask, scaling=DIM ** -0.5)


def _sdpa(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; ms per forward ({LAYERS} layers)")
    print(f"{'rows':>4} {'tokens':>6} {'context':>7} {'sdpa':>8} {'exact':>8} {'ratio':>6}")
    for rows, tokens, context in [(1, 1, 512), (1, 6, 512), (4, 1, 512), (4, 6, 512), (8, 6, 1024),
                                  (1, 1, 2048), (1, 256, 1024)]:
        inputs = _inputs(rows, tokens, context)
        times: dict[str, list[float]] = {"sdpa": [], "exact": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, fn in (("sdpa", _sdpa), ("exact", _exact)):
                    start = time.perf_counter()
                    for _ in range(LAYERS):
                        fn(*inputs)
                    times[name].append((time.perf_counter() - start) * 1e3)
        sdpa, exact = statistics.median(times["sdpa"]), statistics.median(times["exact"])
        print(f"{rows:>4} {tokens:>6} {context:>7} {sdpa:8.2f} {exact:8.2f} {exact / sdpa:6.2f}")


if __name__ == "__main__":
    main()
