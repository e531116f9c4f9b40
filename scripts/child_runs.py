"""What scripts/llamacpp_anchor.py and scripts/quant_fidelity.py share: each engine or format runs in
a process of its own (one model in memory at a time, no allocator or thread state carried over), and
finished runs are kept in a JSON file so an interrupted comparison resumes where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_children(script: str, names: list[str], results: Path, settings: dict, child_args: list[str],
                 env_for: Callable[[str], dict[str, str]] = lambda name: {}) -> dict:
    """Run `script --child NAME --child-out FILE *child_args` for each name without a kept result
    (results kept under other `settings` are dropped) and return every name's result."""
    runs: dict = json.loads(results.read_text()) if results.is_file() else {}
    if runs.get("_settings") != settings:
        runs = {}
    runs["_settings"] = settings
    for name in names:
        if name in runs:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as work:
            out = Path(work) / "result.json"
            done = subprocess.run([sys.executable, script, "--child", name, "--child-out", str(out), *child_args],
                                  env={**os.environ, **env_for(name)})
            if done.returncode != 0:
                raise SystemExit(f"{name} failed ({_exit_reason(done.returncode)}); the runs before it are kept in {results}")
            runs[name] = json.loads(out.read_text())
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(runs))
    return runs


def _exit_reason(code: int) -> str:
    """A child's exit, in words: an illegal instruction is a build for another CPU (a wheel from a cache)."""
    if code >= 0:
        return f"exit status {code}"
    name = signal.Signals(-code).name
    if name == "SIGILL":
        return ("SIGILL: it was built for another CPU; rebuild it here, e.g. pip install --no-cache-dir "
                "--force-reinstall llama-cpp-python")
    return name
