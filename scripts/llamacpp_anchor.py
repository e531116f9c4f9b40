"""The anchor: llama.cpp (through llama-cpp-python) and batchspec's plain decoding on the same bundled
target GGUF, the same SpecBench prompts, batch 1, greedy, side by side from one run.

    pip install -e '.[anchor]'      # llama-cpp-python, built from source (~15 min on 2 cores)
    PYTHONPATH=. python scripts/llamacpp_anchor.py --num-prompts 12 --max-new-tokens 48

Prompts: the ones `batchspec bench` picks (`--num-prompts N` spread over SpecBench's six task groups,
2 per group at 12), chat template applied by the target's tokenizer (batchspec's `encode_prompt`);
llama.cpp is given the very same token ids, so both engines prefill identical prompts. Every prompt
is decoded alone from a fresh state (llama.cpp: `generate(..., reset=True)`, no prefix reuse;
batchspec: a new `ar` engine per prompt), greedy, stopping at the model's end-of-turn tokens or
--max-new-tokens.

Per engine: prefill tok/s (prompt tokens / time to the first generated token), decode tok/s (tokens
after the first / the time after the first), end to end (generated tokens / wall time, prefill
included), each summed over all prompts; and how many outputs agree with batchspec float32's.
Each engine runs in its own child process, one after the other (the float32 1.5B model peaks at
~12 GB while loading): the figures are of one run, on whatever else shared the machine then.
llama-cpp-python is optional (the `anchor` extra), never needed by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from child_runs import run_children  # noqa: E402
from quant_fidelity import common_prefix, cpu_line, prompts  # noqa: E402

# batchspec-<weights>[+prefill-int8]: plain decoding of the target with those weights (and prompt path)
ENGINES = ("llama.cpp", "batchspec-none", "batchspec-int8", "batchspec-int4", "batchspec-int8+prefill-int8",
           "batchspec-int4+prefill-int8")
PROMPT_PATH = "+prefill-int8"


def run_llamacpp(num_prompts: int, max_new_tokens: int, threads: int) -> dict:
    import llama_cpp

    from transformers import GenerationConfig

    from batchspec.bundled import BUNDLED, bundled_model_dir, join_chunks

    chosen, tokenizer = prompts(num_prompts, max_new_tokens)
    generation = GenerationConfig.from_pretrained(bundled_model_dir("target"))
    eos = generation.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work:
        gguf = join_chunks(BUNDLED["target"], Path(work) / "target.gguf")
        n_ctx = max(len(p.token_ids) for p in chosen) + max_new_tokens + 16
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False, seed=0)
        outputs, timings = [], []
        for p in chosen:
            tokens: list[int] = []
            start = time.perf_counter()
            first = None
            llm.reset()  # empties the KV memory: generate() would otherwise reuse the common chat prefix
            for token in llm.generate(list(p.token_ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                      repeat_penalty=1.0, reset=True):
                if first is None:
                    first = time.perf_counter()
                tokens.append(int(token))
                if token in stop or len(tokens) >= max_new_tokens:
                    break
            end = time.perf_counter()
            outputs.append(tokens)
            timings.append({"prefill": first - start, "decode": end - first, "total": end - start})
        version = llama_cpp.__version__
    return {"engine": "llama.cpp", "weights": f"llama-cpp-python {version}, the GGUF as shipped (Q4_K_M)",
            "outputs": outputs, "timings": timings, "prompt_tokens": [len(p.token_ids) for p in chosen],
            "ids": [p.id for p in chosen], "threads": threads, "cpu": cpu_line()}


def run_batchspec(quantization: str, num_prompts: int, max_new_tokens: int) -> dict:
    import torch

    from batchspec.config import SamplingParams, SpecConfig
    from batchspec.kernels import weight_bytes, weights_summary
    from batchspec.build import build_engine
    from batchspec.models import eos_token_ids, load_model

    chosen, _ = prompts(num_prompts, max_new_tokens)
    weights = quantization.removesuffix(PROMPT_PATH)
    prefill = "int8" if quantization.endswith(PROMPT_PATH) else "weights"
    model, tokenizer = load_model(None, role="target", quantization=weights, prefill_kernel=prefill)
    stop = eos_token_ids(model, tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    warm = build_engine(model, SpecConfig(method="ar", batch_size=1), stop)
    warm.generate([list(chosen[0].token_ids[:16])], SamplingParams(max_new_tokens=2))  # first-call setup
    outputs, timings = [], []
    for p in chosen:
        engine = build_engine(model, SpecConfig(method="ar", batch_size=1), stop)
        start = time.perf_counter()
        (seq,) = engine.generate([list(p.token_ids)], params)
        end = time.perf_counter()
        outputs.append(list(seq.generated))
        prefill = engine.stats.prefill_time
        timings.append({"prefill": prefill, "decode": (end - start) - prefill, "total": end - start})
    return {"engine": f"batchspec-{quantization}",
            "weights": f"{weights_summary(model)}; {weight_bytes(model) / 2**30:.2f} GiB",
            "outputs": outputs, "timings": timings, "prompt_tokens": [len(p.token_ids) for p in chosen],
            "ids": [p.id for p in chosen], "threads": torch.get_num_threads(), "cpu": cpu_line()}


def summary(run: dict) -> dict[str, float]:
    t = run["timings"]
    prefill = sum(x["prefill"] for x in t)
    decode = sum(x["decode"] for x in t)
    total = sum(x["total"] for x in t)
    generated = sum(len(o) for o in run["outputs"])
    after_first = generated - len(run["outputs"])
    return {"prefill_tok_s": sum(run["prompt_tokens"]) / prefill, "decode_tok_s": after_first / decode,
            "e2e_tok_s": generated / total, "generated": generated, "wall_s": total}


def report(runs: dict[str, dict], engines: list[str]) -> str:
    any_run = next(iter(runs[e] for e in engines))
    ref = runs.get("batchspec-none")
    lines = [f"CPU: {any_run['cpu']}",
             f"{len(any_run['ids'])} SpecBench prompts (as `batchspec bench` picks them), prompt tokens "
             f"{sum(any_run['prompt_tokens'])} in all ({min(any_run['prompt_tokens'])}-{max(any_run['prompt_tokens'])}), "
             "batch 1, greedy, chat template, fresh prefill per prompt, one engine at a time", ""]
    header = (f"{'engine':>27} | prefill tok/s | decode tok/s | end-to-end tok/s | generated | wall s | "
              "same as batchspec float32")
    lines += [header, "-" * len(header)]
    base = summary(runs["llama.cpp"]) if "llama.cpp" in runs else None
    for name in engines:
        run = runs[name]
        s = summary(run)
        agree = "-"
        if ref is not None and name != "batchspec-none":
            same = sum(a == b for a, b in zip(ref["outputs"], run["outputs"]))
            matched = sum(common_prefix(a, b) for a, b in zip(ref["outputs"], run["outputs"]))
            agree = f"{same}/{len(ref['outputs'])} identical, {100 * matched / sum(map(len, ref['outputs'])):.1f}% tokens"
        lines.append(f"{name:>27} | {s['prefill_tok_s']:>13.1f} | {s['decode_tok_s']:>12.2f} | "
                     f"{s['e2e_tok_s']:>16.2f} | {s['generated']:>9} | {s['wall_s']:>6.0f} | {agree}")
    if base is not None:
        lines.append("")
        for name in engines:
            if name == "llama.cpp":
                continue
            s = summary(runs[name])
            lines.append(f"{name} / llama.cpp: prefill {s['prefill_tok_s'] / base['prefill_tok_s']:.2f}x, decode "
                         f"{s['decode_tok_s'] / base['decode_tok_s']:.2f}x, end to end {s['e2e_tok_s'] / base['e2e_tok_s']:.2f}x")
    lines.append("")
    for name in engines:
        lines.append(f"{name}: {runs[name]['weights']}; {runs[name]['threads']} threads")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", "--limit", type=int, default=12, dest="num_prompts",
                        help="prompts, spread over the six task groups (default 12: two per group)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--engines", default=",".join(e for e in ENGINES if e != "batchspec-int8"),
                        help=f"from {', '.join(ENGINES)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (torch: its default)")
    parser.add_argument("--results", default="runs/llamacpp_anchor.json", help="per-engine results, kept between runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "llama.cpp":
            result = run_llamacpp(args.num_prompts, args.max_new_tokens, args.threads)
        else:
            result = run_batchspec(args.child.removeprefix("batchspec-"), args.num_prompts, args.max_new_tokens)
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as exc:  # not installed, or installed without its dependencies
            parser.error(f"llama-cpp-python cannot be imported ({exc}): pip install -e '.[anchor]' (builds llama.cpp, ~15 min)")
    runs = run_children(__file__, engines, Path(args.results),
                        {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens},
                        ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                         "--threads", str(args.threads)])
    print(report(runs, engines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
