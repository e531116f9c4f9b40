"""Serve the same models twice, plain (`--method ar`) and speculative, and load each server with
`batchspec bench-serve`'s client at several concurrencies: one run, the same prompts, ratios side
by side, and every speculative answer compared with the plain server's.

    python scripts/serve_bench.py --concurrency 1,4,8 --num-prompts 8 --max-tokens 48 \\
        --serve-args "--draft-dtype bfloat16" --json docs/results/serve_bench_<machine>_b1-8.json

Servers run one at a time (never both on the machine at once), each started as `batchspec serve`
in a subprocess and stopped before the next; the first request of each is a warm-up outside the
figures. Needs the RAM of one `batchspec serve` (bundled pair: ~9 GB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from batchspec.bench.specbench import SPECBENCH_FILE, BenchPrompt, select, task_group
from batchspec.prompts import load_prompts
from batchspec.serve.bench import BenchSettings, run_bench

STARTUP_TIMEOUT_S = 900  # first use of the bundled pair converts it from GGUF (minutes)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"server not healthy after {STARTUP_TIMEOUT_S} s")


def serve_and_bench(label: str, serve_args: list[str], prompts: list[str], args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchspec", "serve", "--port", str(port), "--log-level", "warning",
               "--max-num-seqs", str(max(args.concurrency)), *serve_args]
    print(f"[{label}] {shlex.join(command)}", file=sys.stderr, flush=True)
    server = subprocess.Popen(command)
    try:
        wait_healthy(url, server)
        base = BenchSettings(url + "/v1", endpoint=args.endpoint, max_tokens=args.max_tokens)
        asyncio.run(run_bench(base, prompts[:1]))  # warm-up, not counted
        runs = {}
        for concurrency in args.concurrency:
            settings = BenchSettings(url + "/v1", endpoint=args.endpoint, max_tokens=args.max_tokens,
                                     concurrency=concurrency)
            runs[concurrency] = asyncio.run(run_bench(settings, prompts))
            print(f"[{label}] concurrency {concurrency}: {runs[concurrency]['output_throughput']} tok/s",
                  file=sys.stderr, flush=True)
        return runs
    finally:
        server.terminate()
        server.wait(timeout=60)


def table(plain: dict, spec: dict, concurrencies: list[int]) -> str:
    head = ("concurrency", "ar tok/s", "spec tok/s", "speedup", "ar TTFT p50", "spec TTFT p50", "ar TPOT p50",
            "spec TPOT p50", "spec ITL p99", "acc rate", "tok/chunk", "identical")
    rows = []
    for c in concurrencies:
        a, s = plain[c], spec[c]
        same = sum(x is not None and x == y for x, y in zip(a["outputs"], s["outputs"]))
        rows.append((str(c), f"{a['output_throughput']:.2f}", f"{s['output_throughput']:.2f}",
                     f"{s['output_throughput'] / a['output_throughput']:.2f}x",
                     f"{a['ttft_ms']['p50'] / 1e3:.1f} s", f"{s['ttft_ms']['p50'] / 1e3:.1f} s",
                     f"{a['tpot_ms']['p50']:.0f} ms", f"{s['tpot_ms']['p50']:.0f} ms",
                     f"{s['itl_ms']['p99'] / 1e3:.2f} s", f"{s['speculation']['acceptance_rate']}",
                     f"{s['tokens_per_chunk']}", f"{same}/{len(a['outputs'])}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrencies")
    p.add_argument("--num-prompts", type=int, default=8, help="SpecBench prompts, spread over the task groups")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--serve-args", default="", help="extra `batchspec serve` options for both servers "
                   "(models, dtypes)")
    p.add_argument("--spec-args", default="--method ragged", help="the speculative server's method options")
    p.add_argument("--json", help="write both servers' reports here")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    records = [r for r in load_prompts(SPECBENCH_FILE) if r.error is None]
    pool = [BenchPrompt(r.id, r.text, r.category, task_group(r.category), ()) for r in records]
    prompts = [p.text for p in select(pool, num_prompts=args.num_prompts)]
    common = shlex.split(args.serve_args)
    plain = serve_and_bench("ar", [*common, "--method", "ar"], prompts, args)
    spec = serve_and_bench("spec", [*common, *shlex.split(args.spec_args)], prompts, args)
    print(f"{len(prompts)} SpecBench prompts (spread over the task groups), max_tokens {args.max_tokens}, "
          f"{args.endpoint} endpoint, greedy; serve options: {args.serve_args or '(defaults)'}; "
          f"speculative: {args.spec_args}")
    print(table(plain, spec, args.concurrency))
    print("identical: speculative answers equal to the plain server's, text for text")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "prompts": prompts, "ar": plain,
                                               "spec": spec}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
