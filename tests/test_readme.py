"""The README's quick start runs as printed: its Python block (verbatim on the bundled pair, and on the
tiny pair with only the model folders swapped in) and its curl request against `batchspec serve`."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_serve import chat_pair, serving  # noqa: F401 (chat_pair: a fixture)

import batchspec
from batchspec.models import load_pair
from batchspec.serve.app import ServeOptions, create_app

README = Path(__file__).parent.parent / "README.md"


def quick_start(language: str) -> list[str]:
    """The code blocks of `language` in the README's "Quick start" section, in order."""
    section = README.read_text(encoding="utf-8").split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def run_python_block(model_config: type) -> str:
    """Execute the quick start's Python block with `ModelConfig` bound to `model_config`; its stdout."""
    (block,) = quick_start("python")
    namespace = {"__name__": "readme"}
    code = block.replace("from batchspec import LLM, ModelConfig, SamplingParams, SpecConfig",
                         "from batchspec import LLM, SamplingParams, SpecConfig")
    assert code != block, "the quick start no longer imports what this test expects"
    namespace["ModelConfig"] = model_config
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    return out.getvalue()


def test_python_quick_start_runs_on_the_tiny_pair(tiny_pair_dirs):
    """The block's calls and fields exist and print one line per prompt (models swapped for the tiny
    pair, everything else as printed)."""
    target, draft = tiny_pair_dirs

    def tiny(**options: object) -> batchspec.ModelConfig:
        return batchspec.ModelConfig(str(target), str(draft), **options)

    out = run_python_block(tiny)
    accepted, drafted = out.split()[-2:]  # the last prompt's `out.accepted, out.drafted`
    assert len(out.splitlines()) >= 2 and int(accepted) <= int(drafted)


@pytest.mark.real
def test_python_quick_start_runs_verbatim_on_the_bundled_pair():
    out = run_python_block(batchspec.ModelConfig)
    assert out.strip(), "the quick start printed nothing"


def test_curl_quick_start_is_answered_by_the_server(chat_pair):
    """The curl line, pointed at a server on the tiny pair started with serve's defaults and a key."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    block = quick_start("bash")[-1]
    curl = block[block.index("curl"):].replace("\\\n", " ").strip()
    assert curl.startswith("curl -s localhost:8000/v1/chat/completions")
    app = create_app(load_pair(chat_pair), chat_pair, batchspec.SpecConfig(), ServeOptions(api_key="readme-key"))
    with serving(app) as url:
        command = curl.replace("localhost:8000", url.removeprefix("http://"), 1)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KEY": "readme-key"})
    assert done.returncode == 0, done.stderr
    assert '"choices"' in done.stdout and '"usage"' in done.stdout, done.stdout
