"""The scripts in examples/ run as documented (on the tiny pair), and say what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_serve import chat_pair, make_app, serving  # noqa: F401 (chat_pair: a fixture)

from batchspec.models import load_pair

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_offline_example_decodes_exactly(tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    out = run("offline.py", "--target", str(target), "--draft", str(draft), "--no-chat-template")
    lines = out.strip().splitlines()
    assert len(lines) == 3 and all(line.endswith("identical to plain decoding: True") for line in lines)


def test_step_api_example_adds_and_aborts_while_decoding(tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    out = run("step_api.py", "--target", str(target), "--draft", str(draft))
    finished = [line.split()[3] for line in out.splitlines() if line.startswith("step ")]
    assert sorted(finished) == ["0", "2"]  # the aborted request 1 never finishes; the late one does


def test_openai_client_example_talks_to_the_server(chat_pair):
    with serving(make_app(load_pair(chat_pair), chat_pair)) as url:
        out = run("openai_client.py", "--base-url", url + "/v1")
    assert out.startswith("chat:") and "\nstream:" in out
