"""Fidelity of the quantized bundled target to its float32 form: plain greedy decoding of the bench's
SpecBench prompts (the 12 `batchspec bench` picks by default: 2 per task group, long summarization and
RAG prompts included) with each weight format, compared token by token with float32.

    PYTHONPATH=. python scripts/quant_fidelity.py --formats none,int8,int4 --max-new-tokens 48 \
        --tokens runs/fidelity.json

Each format is decoded in its own child process, one after the other (the float32 1.5B model peaks at
~12 GB while loading; two at once do not fit a 23 GB machine), and its tokens are kept in --tokens, so
a rerun decodes only the formats missing there. Formats: `none` (float32, the reference), `int8`,
`int4` (on the bundled target: the GGUF's own Q4_K blocks, `batchspec.gguf_int4`), `int4-float`
(int4 g32 fitted to the float32 weights instead, what a user model gets), `int4-g128`.

Reported per format: how many outputs are identical to float32's, token match (positions before the
first divergence / float32's tokens, over all prompts) and each prompt's first-divergence index
(`=` where identical). Not exactness: every format is exact against plain decoding of itself; this is
what the smaller weights cost against float32. ROUGE or similar would say nothing about that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from child_runs import run_children

FORMATS = {  # name -> (quantization, group size, env)
    "none": ("none", 32, {}),
    "int8": ("int8", 32, {}),
    "int4": ("int4", 32, {}),
    "int4-float": ("int4", 32, {"BATCHSPEC_GGUF_INT4": "0"}),
    "int4-g128": ("int4", 128, {}),
}


def cpu_line() -> str:
    model = ""
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        match = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
        model = match.group(1).strip() if match else ""
        flags = set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*|avx2)\b", text))
    except OSError:
        pass
    import torch

    return (f"{model or platform.processor()}, {os.cpu_count()} cores, flags: {' '.join(sorted(flags)) or 'none'}; "
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")


def prompts(num_prompts: int, max_new_tokens: int):
    from batchspec.bench.specbench import SPECBENCH_FILE, encode_prompts, select
    from batchspec.bundled import bundled_model_dir
    from batchspec.models import _load_tokenizer, encode_prompt

    tokenizer = _load_tokenizer(bundled_model_dir("target"), None)
    candidates, _ = encode_prompts(SPECBENCH_FILE, lambda text: encode_prompt(tokenizer, text))
    return select(candidates, num_prompts), tokenizer


def decode_one_format(name: str, num_prompts: int, max_new_tokens: int) -> dict:
    """Child process: load the target in `name`, decode every prompt plainly, return tokens and timings."""
    import torch

    from batchspec.kernels import weight_bytes, weights_summary
    from batchspec.models import eos_token_ids, load_model
    from batchspec.reference import greedy_decode

    quantization, group, _ = FORMATS[name]
    chosen, _ = prompts(num_prompts, max_new_tokens)
    start = time.perf_counter()
    model, tokenizer = load_model(None, role="target", quantization=quantization, group_size=group)
    loaded = time.perf_counter() - start
    stop = eos_token_ids(model, tokenizer)
    outputs, seconds = [], []
    for p in chosen:
        t0 = time.perf_counter()
        outputs.append(greedy_decode(model, list(p.token_ids), max_new_tokens, stop))
        seconds.append(time.perf_counter() - t0)
    return {"format": name, "weights": weights_summary(model), "bytes": weight_bytes(model), "load_s": loaded,
            "ids": [p.id for p in chosen], "groups": [p.group for p in chosen],
            "prompt_tokens": [len(p.token_ids) for p in chosen], "outputs": outputs, "seconds": seconds,
            "threads": torch.get_num_threads(), "cpu": cpu_line()}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report(runs: dict[str, dict], formats: list[str]) -> str:
    ref = runs["none"]
    lines = [f"CPU: {ref['cpu']}",
             f"prompts: {len(ref['ids'])} SpecBench prompts as `batchspec bench` picks them (2 per task group), "
             f"prompt tokens {min(ref['prompt_tokens'])}-{max(ref['prompt_tokens'])}, "
             f"max {len(max(ref['outputs'], key=len))} new tokens, greedy, plain decoding (batchspec.reference), "
             "chat template", ""]
    for name in formats:
        run = runs[name]
        lines.append(f"{name:>10}: {run['weights']}; {run['bytes'] / 2**30:.2f} GiB; "
                     f"decoding took {sum(run['seconds']):.0f} s (not a speed comparison: one run each, machine shared)")
    lines.append("")
    header = f"{'format':>10} | identical | token match | first divergence per prompt (= identical)"
    lines += [header, "-" * len(header)]
    for name in formats:
        if name == "none":
            continue
        run = runs[name]
        matched = total = identical = 0
        firsts = []
        for a, b in zip(ref["outputs"], run["outputs"]):
            n = common_prefix(a, b)
            matched += n
            total += len(a)
            same = a == b
            identical += same
            firsts.append("=" if same else str(n))
        lines.append(f"{name:>10} | {identical:>4}/{len(ref['outputs']):<4} | {100 * matched / total:>10.1f}% | "
                     f"{' '.join(firsts)}")
    lines += ["", "prompts: " + " ".join(f"{i}({g})" for i, g in zip(ref["ids"], ref["groups"]))]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="none,int8,int4")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tokens", default="runs/quant_fidelity.json", help="per-format tokens, kept between runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(decode_one_format(args.child, args.num_prompts, args.max_new_tokens)))
        return 0
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    if "none" not in formats:
        formats.insert(0, "none")
    runs = run_children(__file__, formats, Path(args.tokens),
                        {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens},
                        ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)],
                        lambda name: FORMATS[name][2])
    print(report(runs, formats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
